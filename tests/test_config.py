import os
import re
import socket
from pathlib import Path

import pytest
import tomli_w
import tomllib

from difftune.cli import main
from difftune.config import Config, load_config, reference_markdown
from difftune.errors import DifftuneError
from difftune.families import FAMILY_OPTIONS

REPO = Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted((REPO / "configs").glob("*.toml"))


def test_configs_exist():
    assert {
        "tiny_lora.toml",
        "tiny_dora.toml",
        "sd15_lora.toml",
        "sdxl_lora.toml",
        "flux_lora.toml",
        "qwen_image_lora.toml",
        "qwen_image_1024_lora.toml",
    } <= {p.name for p in CONFIG_FILES}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_shipped_config_validates(path, tmp_path):
    config = load_config(path)
    assert config.train.max_steps >= 1
    # The resolved form, as written beside every run, reloads to the same config.
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(config.to_toml())
    assert load_config(resolved) == config


@pytest.mark.parametrize(
    "content, message",
    [
        ("[adapter]\nrnak = 8\n", r"adapter\.rnak: unknown key; allowed in \[adapter\]: kind, rank, alpha"),
        ("[optimiser]\nlearning_rate = 1e-4\n", r"optimiser: unknown key; allowed sections: model, data"),
        ('[train]\nmax_steps = "100"\n', r"train\.max_steps: Input should be a valid integer \(got '100'\)"),
        ("[train\nmax_steps = 5\n", r"not valid TOML"),
    ],
    ids=["unknown-key", "unknown-section", "wrong-type", "malformed"],
)
def test_bad_files_fail_naming_the_file_and_key(tmp_path, content, message):
    path = tmp_path / "job.toml"
    path.write_text(content)
    with pytest.raises(DifftuneError, match=message) as err:
        load_config(path)
    assert str(err.value).startswith(str(path))


def test_bad_choice_lists_the_allowed_values():
    with pytest.raises(
        DifftuneError,
        match=r"adapter\.kind: Input should be 'lora', 'dora', 'loha', 'lokr', 'none', 'embedding' or 'controlnet'",
    ):
        load_config(None, ["adapter.kind=ia3"])


def test_range_and_cross_section_checks():
    with pytest.raises(DifftuneError, match=r"data\.resolution: .*multiple of 8"):
        load_config(None, ["data.resolution=500"])
    with pytest.raises(DifftuneError, match=r"optim\.betas: .*each beta must be in \[0, 1\)"):
        load_config(None, ["optim.betas=[0.9, 1.5]"])
    # 16-bit storage with fp32 compute is for the denoiser's frozen layers, alone.
    assert load_config(None, ["model.weight_dtype=fp16"]).model.weight_dtype == "fp16"
    with pytest.raises(
        DifftuneError, match=r"weight_dtype = \"bf16\" with train\.mixed_precision = \"no\" .*a full fine-tune has none"
    ):
        load_config(None, ["model.weight_dtype=bf16", "adapter.kind=none"])
    with pytest.raises(DifftuneError, match=r"model\.quantize stores them quantized: choose one"):
        load_config(None, ["model.weight_dtype=fp16", "model.quantize=int8"])
    with pytest.raises(DifftuneError, match=r"train\.compile does not support yet"):
        load_config(None, ["model.weight_dtype=fp16", "train.compile=true"])
    # fp8 storage computes in any mixed precision but torchao's FP8 training, which wants bf16 weights to cast.
    assert load_config(None, ["model.weight_dtype=fp8", "train.mixed_precision=bf16"]).stores_frozen_weights
    with pytest.raises(
        DifftuneError, match=r"weight_dtype = \"fp8\" keeps the denoiser's frozen weights in fp8, and a full fine-tune"
    ):
        load_config(None, ["model.weight_dtype=fp8", "adapter.kind=none"])
    with pytest.raises(
        DifftuneError, match=r"in fp8, and train\.mixed_precision = \"fp8\" casts bf16 weights .*use one or the other"
    ):
        load_config(None, ["model.weight_dtype=fp8", "train.mixed_precision=fp8"])


def test_overrides_are_read_as_the_field_type():
    config = load_config(
        None,
        [
            "adapter.rank=8",
            "train.output_dir=123",  # a text field keeps digits as text
            'sample.prompts=["a cat", "a dog"]',
            "adapter.kind=dora",
            "optim.learning_rate=3e-4",
            "data.random_flip=true",
        ],
    )
    assert config.adapter.rank == 8
    assert config.train.output_dir == str(Path.cwd() / "123")  # text, not the number 123; a path, so absolute
    assert config.sample.prompts == ["a cat", "a dog"]
    assert config.adapter.kind == "dora"
    assert config.optim.learning_rate == pytest.approx(3e-4)
    assert config.data.random_flip is True


@pytest.mark.parametrize(
    "override, message",
    [
        ("rank=8", "must look like section.key=value"),
        ("adapter.rank", "must look like section.key=value"),
        ("adapter.rnak=8", "unknown key adapter.rnak; allowed in \\[adapter\\]: kind, rank"),
        ("trian.max_steps=8", "unknown section 'trian'"),
        ("train.max_steps=many", "train.max_steps: Input should be a valid integer"),
    ],
)
def test_bad_overrides_fail_naming_the_key(override, message):
    with pytest.raises(DifftuneError, match=message):
        load_config(None, [override])


def test_defaults_that_follow_other_fields():
    config = load_config(None, ["adapter.rank=12", "data.resolution=64"])
    assert config.adapter.alpha == 12.0
    assert config.sample.resolution == 64
    assert load_config(None, ["adapter.alpha=4"]).adapter.alpha == 4.0


def test_config_command_prints_resolved_toml(capsys):
    assert main(["config", "--config", str(REPO / "configs/tiny_lora.toml"), "train.max_steps=7"]) == 0
    printed = capsys.readouterr().out
    assert "max_steps = 7" in printed
    assert 'kind = "lora"' in printed


def test_cli_reports_bad_config_without_traceback(capsys, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nmax_step = 5\n")
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "train.max_step: unknown key" in err and "Traceback" not in err


def test_missing_file():
    with pytest.raises(DifftuneError, match="config file no/such/file.toml does not exist"):
        load_config("no/such/file.toml")


def test_the_config_reference_page_is_in_sync():
    readme = (REPO / "docs" / "reference" / "config.md").read_text()
    start, end = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
    assert start in readme and end in readme
    documented = readme.split(start)[1].split(end)[0].strip()
    assert documented == reference_markdown(FAMILY_OPTIONS).strip(), "run `python scripts/update_docs.py`"


def test_every_field_has_a_description():
    for section, section_field in Config.model_fields.items():
        for name, field in section_field.annotation.model_fields.items():
            assert field.description, f"{section}.{name} has no description"


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci/run").read_text()
    command = "python -m pytest -q"
    assert f'pip install -e ".[dev]" && {command}' in readme
    assert ci.rstrip().splitlines()[-1] == command


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_accelerate_configs_are_valid(path):
    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(path)
    assert config.distributed_type.value in ("MULTI_GPU", "FSDP") and config.num_processes >= 2
    if config.distributed_type.value == "FSDP":
        assert config.fsdp_config["fsdp_version"] == 2


def test_sample_command_offers_only_flags_that_apply():
    from difftune.cli import build_parser

    parser = build_parser()
    sample_help = parser._subparsers._group_actions[0].choices["sample"].format_help()
    assert "--every-steps" not in sample_help and "--before" not in sample_help
    for flag in ("--every-steps", "--before"):
        with pytest.raises(SystemExit):
            parser.parse_args(["sample", "--base", "b", "--out", "o", "--prompt", "p", flag, "1"])


@pytest.mark.parametrize(
    ("text", "expected"), [("true", True), ("false", False), ("False", False), ("0", False), ("yes", True)]
)
def test_boolean_flags_read_true_and_false(text, expected):
    from difftune.cli import _parse_bool

    assert _parse_bool(text) is expected


def test_boolean_flag_rejects_other_words():
    import argparse

    from difftune.cli import _parse_bool

    with pytest.raises(argparse.ArgumentTypeError, match="expected true or false, got 'maybe'"):
        _parse_bool("maybe")


@pytest.mark.parametrize(("value", "expected"), [("true", "on"), ("false", "off"), ('"auto"', "auto"), ('"on"', "on")])
def test_device_switches_read_old_booleans_and_default_to_auto(tmp_path, value, expected):
    assert load_config(None).train.tf32 == "auto" and load_config(None).train.cudnn_benchmark == "auto"
    path = tmp_path / "job.toml"
    path.write_text(f"[train]\ntf32 = {value}\ncudnn_benchmark = {value}\n")
    config = load_config(path)
    assert config.train.tf32 == expected and config.train.cudnn_benchmark == expected


def test_paths_in_a_file_are_relative_to_the_file_and_overrides_to_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "project" / "models" / "base").mkdir(parents=True)
    (tmp_path / "project" / "jobs").mkdir()
    job = tmp_path / "project" / "jobs" / "job.toml"
    job.write_text(
        '[model]\nbase = "../models/base"\nvae = "madebyollin/taesd"\n'
        '[data]\npath = "../images"\n[train]\noutput_dir = "out"\n[cache]\ndir = "~/cache-here"\n'
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(job, ["validation.path=held_out"])
    assert config.model.base == str(tmp_path / "project" / "models" / "base")
    assert config.model.vae == "madebyollin/taesd"  # no such path beside the file: a hub id, kept as written
    assert config.data.path == str(tmp_path / "project" / "images")  # a folder to be, still relative to the file
    assert config.train.output_dir == str(tmp_path / "project" / "jobs" / "out")
    assert config.cache.dir == str(Path.home() / "cache-here")
    assert config.validation.path == str(elsewhere / "held_out")
    # The resolved config, written anywhere, reads back the same.
    (tmp_path / "copy.toml").write_text(config.to_toml())
    assert load_config(tmp_path / "copy.toml") == config


def test_the_default_job_resolves_from_any_working_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["config", "--config", str(REPO / "configs" / "tiny_lora.toml")]) == 0
    resolved = tomllib.loads(capsys.readouterr().out)
    assert resolved["model"]["base"] == str(REPO / "models" / "tiny-sd")
    assert resolved["data"]["path"] == str(REPO / "examples" / "purple")
    assert resolved["train"]["output_dir"] == str(REPO / "output" / "tiny_lora")


def test_a_hub_id_fails_at_once_offline_or_unreachable(monkeypatch):
    from huggingface_hub import constants

    from difftune.config import ModelConfig
    from difftune.families import load_components

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        DifftuneError, match=r"model.base someone/no-such-model: not a local folder or file .*offline mode is on"
    ):
        load_components(ModelConfig(base="someone/no-such-model"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as closed:  # a loopback port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(
        DifftuneError, match=rf"model.base someone/no-such-model: .*Cause: http://127.0.0.1:{port} is unreachable"
    ):
        load_components(ModelConfig(base="someone/no-such-model"))


# Configs that used to crash or fail late: each fails with one line naming its key, before the work it would spoil.


def _refused_before(monkeypatch, capsys, overrides: list[str], stage: str) -> str:
    """`difftune train` with `overrides` on the tiny default job: exit 2 and the one error line, with the run stopped
    before `stage` (loading the model, or filling the caches) could start."""
    import difftune.training.train as train_module

    def not_reached(*args, **kwargs):
        raise AssertionError(f"{stage} started before the config was refused")

    monkeypatch.setattr(train_module, {"model load": "load_components", "caches": "_fill_caches"}[stage], not_reached)
    capsys.readouterr()
    assert main(["train", "--config", str(REPO / "configs" / "tiny_lora.toml"), *overrides]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and lines[0].startswith("difftune: error: "), err
    return err


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.resolution=2147483648"], r"data\.resolution: Input should be less than or equal to 16384"),
        (["train.output_dir={file}"], r"train\.output_dir .*afile: .*afile is a file, not a folder"),
        (["cache.dir={file}/latents"], r"cache\.dir .*afile/latents: .*afile is a file, not a folder"),
        (["data.path={tmp}/missing"], r"data\.path .*missing: does not exist"),
        (["validation.path={tmp}/missing"], r"validation\.path .*missing: does not exist"),
        (
            ["train.batch_size=1000000000", "data.repeats=100000000"],  # repeated enough to hold it
            r"train\.batch_size 1000000000: one batch of images at 32 px is 11,444 GiB, more than",
        ),
        (
            ["adapter.kind=none", "model.quantize=int8"],
            r"^difftune: error: .*: invalid config\n  model\.quantize = \"int8\" needs an adapter",
        ),
    ],
    ids=[
        "huge-resolution",
        "output-dir-a-file",
        "cache-dir-under-a-file",
        "missing-data",
        "missing-validation",
        "batch-that-cannot-fit",
        "cross-section",
    ],
)
def test_bad_configs_fail_before_the_model_loads(tmp_path, monkeypatch, capsys, overrides, message):
    (tmp_path / "afile").write_text("")
    overrides = [o.format(file=tmp_path / "afile", tmp=tmp_path) for o in overrides]
    err = _refused_before(monkeypatch, capsys, [f"train.output_dir={tmp_path / 'run'}", *overrides], "model load")
    assert re.search(message, err, re.MULTILINE), err
    assert "{'model'" not in err  # a check across sections no longer prints the whole config


def test_a_family_that_does_not_fit_the_base_and_unknown_targets_fail_before_any_work(tmp_path, monkeypatch, capsys):
    from diffusers import StableDiffusionXLPipeline

    def not_loaded(*args, **kwargs):
        raise AssertionError("the SDXL pipeline was loaded")

    monkeypatch.setattr(StableDiffusionXLPipeline, "from_pretrained", not_loaded)
    err = _refused_before(
        monkeypatch, capsys, [f"train.output_dir={tmp_path / 'a'}", "model.family=sdxl"], "model load"
    )
    assert re.search(
        r"model\.family = \"sdxl\": model\.base .*tiny-sd is a StableDiffusionPipeline of the sd family; "
        r"set model\.family = \"auto\" or \"sd\"",
        err,
    ), err
    err = _refused_before(
        monkeypatch,
        capsys,
        [f"train.output_dir={tmp_path / 'b'}", 'adapter.target_modules=["nope_proj"]'],
        "model load",
    )
    assert re.search(
        r"adapter\.target_modules: 'nope_proj' names no module of the unet; its layers are named .*attn1\.to_q, .*"
        r"conv1, .*to_out\.0",
        err,
    ), err
    err = _refused_before(
        monkeypatch,
        capsys,
        [
            f"train.output_dir={tmp_path / 'c'}",
            "adapter.text_encoder=true",
            'adapter.text_encoder_targets.text_encoder=["to_q"]',
        ],
        "model load",
    )
    assert (
        "adapter.text_encoder_targets.text_encoder: 'to_q' names no module of the text_encoder; its layers are named"
        in err
    )
    assert "self_attn.q_proj" in err


def test_targets_checked_on_disk_and_once_loaded_say_the_same():
    """The targets a run names are checked in the base folder's safetensors headers before any import, and again on
    the loaded model (a hub id, a single file): one refusal, in the same words, for the same target."""
    from difftune.adapters.trained import check_targets
    from difftune.families import load_components
    from difftune.training.preflight import check_before_start

    config = load_config(REPO / "configs" / "tiny_lora.toml", ['adapter.target_modules=["to_q", "nope_proj"]'])
    with pytest.raises(DifftuneError) as on_disk:
        check_before_start(config)
    with pytest.raises(DifftuneError) as loaded:
        check_targets(load_components(config.model), config.adapter)
    said, listed = str(on_disk.value).split("; its layers are named ")
    assert said == "adapter.target_modules: 'nope_proj' names no module of the unet"
    assert str(loaded.value).startswith(said + "; its layers are named ")
    assert {"attn1.to_q", "conv1", "to_out.0", "proj_in"} <= set(listed.split(", "))


def test_a_config_file_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "job.toml"
    path.write_bytes(b"\xef\xbb\xbf" + b"[train]\nmax_steps = 7\n")
    assert load_config(path).train.max_steps == 7


def test_family_options_are_checked_by_the_family(tiny_base, tiny_flux_base):
    from difftune.config import ModelConfig
    from difftune.families import load_components

    with pytest.raises(
        DifftuneError,
        match=r"model.family_options.guidance: not a setting of Stable Diffusion 1.x / 2.x "
        r"bases \(theirs: none\)",
    ):
        load_components(ModelConfig(base=str(tiny_base), family_options={"guidance": 3.5}))
    with pytest.raises(DifftuneError) as err:
        load_components(ModelConfig(base=str(tiny_flux_base), family_options={"guidance": -1.0, "shift": 3}))
    assert "model.family_options.guidance: Input should be greater than or equal to 0 (got -1.0)" in str(err.value)
    assert (
        "model.family_options.shift: not a setting of Flux.1-class flow-matching transformers bases (theirs: "
        "guidance, text_padding_mask)" in str(err.value)
    )
    components = load_components(ModelConfig(base=str(tiny_flux_base), family_options={"guidance": 3.5}))
    assert components.family_options.guidance == 3.5 and components.family_options.text_padding_mask is False


def test_keys_that_moved_into_family_tables_are_read_from_old_files_runs_and_overrides(tmp_path):
    """Configs, checkpoints and adapter metadata written before the family-owned tables record the old keys (mostly at
    their defaults, which a family without the setting would refuse): defaults are dropped, other values moved."""
    from difftune.training.checkpoint import check_resumable

    old = tmp_path / "old.toml"
    old.write_text(
        "[model]\nguidance = 3.5\ntext_padding_mask = false\n[adapter]\ntext_encoder_target_modules = []\n"
        'text_encoder_2_target_modules = ["q_proj"]\n'
    )
    config = load_config(old)
    assert config.model.family_options == {"guidance": 3.5}
    assert config.adapter.text_encoder_targets == {"text_encoder_2": ["q_proj"]}
    assert load_config(None, ["model.guidance=2.0"]).model.family_options == {"guidance": 2.0}
    assert load_config(None, ['adapter.text_encoder_targets.text_encoder=["q_proj"]']).adapter.text_encoder_targets == {
        "text_encoder": ["q_proj"]
    }
    with pytest.raises(DifftuneError, match=r"model.base is not a table; use model.base=value"):
        load_config(None, ["model.base.x=1"])

    current = load_config(None)
    saved = tomllib.loads(current.to_toml())
    saved["model"] |= {"guidance": 1.0, "text_padding_mask": False}
    saved["adapter"] |= {"text_encoder_target_modules": [], "text_encoder_2_target_modules": []}
    check_resumable(tomli_w.dumps(saved), current, 1, 1, print_fn=lambda *_: None)  # the same run: resumable
    saved["model"]["guidance"] = 4.0
    with pytest.raises(DifftuneError, match=r"model.family_options: \{'guidance': 4.0\} -> \{\}"):
        check_resumable(tomli_w.dumps(saved), current, 1, 1, print_fn=lambda *_: None)


def test_text_encoder_targets_name_a_text_encoder_the_family_adapts(make_config, tiny_flux_base):
    from difftune.training.train import train

    with pytest.raises(
        DifftuneError,
        match=r"adapter.text_encoder_targets.text_encoder_2: not a text encoder "
        r"Flux.1-class flow-matching transformers adapters train; theirs: text_encoder",
    ):
        train(
            make_config(
                model__base=str(tiny_flux_base),
                adapter__text_encoder=True,
                **{"adapter__text_encoder_targets__text_encoder_2": ["q"]},
            )
        )


# What a held-back pass fed the config reader (issue 59): each used to crash with a traceback, or to run.


def _config_file(tmp_path, content: bytes) -> Path:
    path = tmp_path / "job.toml"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            bytes(range(256)),
            r"config file .*job\.toml: not text \(byte 128 is no UTF-8 character\); save it as UTF-8 TOML",
        ),
        (
            b"",
            r"config file .*job\.toml sets nothing: a job names at least its base and its data \(model\.base, "
            r"data\.path\)",
        ),
        (b"# only a comment\n", r"sets nothing"),
        (
            b'[train]\noutput_dir = ""\n',
            r"train\.output_dir: is empty; name a folder \(an empty path would mean the working "
            r"directory\) \(got ''\)",
        ),
    ],
)
def test_config_files_that_cannot_be_a_job_are_refused_naming_why(tmp_path, content, message):
    with pytest.raises(DifftuneError, match=message):
        load_config(_config_file(tmp_path, content))


def test_a_utf16_config_with_its_bom_is_read(tmp_path):
    """Windows Notepad's "Unicode" is UTF-16 with a BOM: it used to stop on a UnicodeDecodeError."""
    path = tmp_path / "job.toml"
    path.write_text("[train]\nmax_steps = 7\n", encoding="utf-16")
    assert load_config(path).train.max_steps == 7


def test_a_folder_as_the_config_is_refused(tmp_path):
    with pytest.raises(DifftuneError, match=rf"config file {re.escape(str(tmp_path))} is a folder; pass a \.toml file"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.seed=99999999999999999999999", r"train\.seed: Input should be less than or equal to 4294967295"),
        ("prior.seed=-1", r"prior\.seed: Input should be greater than or equal to 0"),
        ("optim.learning_rate=1e30", r"optim\.learning_rate: Input should be less than or equal to 10"),
        (
            "optim.text_encoder_learning_rate=1e30",
            r"optim\.text_encoder_learning_rate: Input should be less than or equal",
        ),
        ('train.output_dir=""', r"train\.output_dir: is empty"),
        ("train.output_dir=", r"train\.output_dir: is empty"),
        ('data.path=""', r"data\.path: is empty"),
    ],
)
def test_overrides_that_would_crash_late_or_run_wild_are_refused(override, message):
    """A seed numpy refuses (it stopped after 37 s of loading), a learning rate of 1e30, an empty output folder (the
    run's files went into the working directory) or data path (51 s scanning it): refused by the reader, naming the
    key."""
    with pytest.raises(DifftuneError, match=message):
        load_config(None, [override])


REFUSE_BEFORE_IMPORTS = """
import sys
from difftune.cli import main

code = main(["train", *sys.argv[1:]])
print(code, "torch" in sys.modules, "diffusers" in sys.modules)
"""


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            ["model.base=../models/nothing-here"],
            "model.base ../models/nothing-here: no such folder or file here, and not a hub id",
        ),
        (["model.base=my_model.safetensors"], "model.base my_model.safetensors: no such folder or file here"),
        # A hub id that cannot be fetched is the first and only line, not the memory plan's failure to read it.
        (["model.base=someone/no-such-model"], "model.base someone/no-such-model: not a local folder or file"),
        (['data.path=""'], "data.path: is empty"),
        (["data.path=configs"], "configs holds no images"),  # named before the base loads (8.5 s), not after
        (
            ['data.datasets=[{path = "examples/purple"}, {path = "configs"}]'],
            "data.datasets[1].path",  # an empty one among several, by its place (it was named after 13 s of loading)
        ),
        # Numbers that cannot train: refused in milliseconds (600,000 prompts were tokenised first, silently).
        (["train.batch_size=600000"], "a batch of 600000 is more than the data holds (at most 16 images in"),
        (["optim.max_grad_norm=inf"], "optim.max_grad_norm: Input should be a finite number (got inf)"),
        (["data.loss_weight=inf"], "data.loss_weight: Input should be a finite number (got inf)"),
        (["train.seed=-1"], "train.seed: Input should be greater than or equal to 0"),
        (["--config", "/"], "config file / is a folder"),
        (
            ["model.family=flux"],
            'models/tiny-sd is a StableDiffusionPipeline of the sd family; set model.family = "auto" or "sd"',
        ),
        (['adapter.target_modules=["nope_proj"]'], "adapter.target_modules: 'nope_proj' names no module of the unet"),
        (
            ["adapter.text_encoder=true", 'adapter.text_encoder_targets.text_encoder=["to_q"]'],
            "adapter.text_encoder_targets.text_encoder: 'to_q' names no module of the text_encoder",
        ),
    ],
)
def test_refusals_that_need_no_weights_come_before_the_heavy_imports(arguments, message):
    """A config error that needs no weights is said before torch or diffusers is imported (the seconds of imports
    and loading came first: 27-34 s under load for a missing base); checked by what the process imported, not timed."""
    import subprocess
    import sys

    from conftest import REPO

    offline = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the hub unreachable, wherever the tests run
    run = subprocess.run(
        [sys.executable, "-c", REFUSE_BEFORE_IMPORTS, *arguments],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=offline,
    )
    assert run.stdout.split() == ["2", "False", "False"], run.stdout + run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr
    assert run.stderr.startswith("difftune: error: "), run.stderr  # the error first: no plan or warning before it


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device may have FP8 tensor cores")
@pytest.mark.parametrize(
    ("precision", "message"),
    [
        ("fp8", 'train.mixed_precision = "fp8" needs a GPU with FP8 tensor cores (compute capability 8.9 or newer'),
        ("fp16", 'train.mixed_precision = "fp16" needs a CUDA device; use "bf16" or "no" here'),
    ],
)
def test_a_precision_the_device_lacks_is_refused_before_diffusers_is_imported(precision, message):
    """Asking the device needs torch (a second), not diffusers and the families (5 s idle, 30 s under load)."""
    import subprocess
    import sys

    from conftest import REPO

    run = subprocess.run(
        [sys.executable, "-c", REFUSE_BEFORE_IMPORTS, f"train.mixed_precision={precision}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.stdout.split() == ["2", "True", "False"], run.stdout + run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr


def test_config_command_shows_the_family_it_detects(capsys):
    """`difftune config` printed `family = "auto"`; it prints the family the base is read as, as a run records it."""
    assert main(["config", "--config", str(REPO / "configs" / "flux_lora.toml")]) == 0
    assert tomllib.loads(capsys.readouterr().out)["model"]["family"] == "flux"
    assert main(["config", "model.base=Qwen/Qwen-Image"]) == 0  # a kept hub id: known offline
    assert tomllib.loads(capsys.readouterr().out)["model"]["family"] == "qwen_image"


def test_an_adapter_files_kind_is_read_from_its_peft_configs():
    import peft

    from difftune.adapter_kinds import KINDS, file_kind

    assert file_kind({}, "unet") is KINDS["lora"]  # a file recording no type: diffusers' LoRA
    assert file_kind({"unet.peft_type": "LORA", "unet.use_dora": True}, "unet") is KINDS["dora"]
    assert file_kind({"transformer.peft_type": "PeftType.LOKR"}, "transformer") is KINDS["lokr"]
    for name, config_class in (("loha", peft.LoHaConfig), ("lokr", peft.LoKrConfig)):
        built = KINDS[name].peft_config(load_config(None, [f"adapter.kind={name}"]).adapter, ["to_q"])
        assert type(built) is config_class and built.peft_type.value == KINDS[name].peft_type
    with pytest.raises(DifftuneError, match=r"unet: a peft ADALORA adapter, which difftune does not read"):
        file_kind({"unet.peft_type": "ADALORA"}, "unet")


def test_every_subcommand_has_a_description_and_every_option_help(capsys):
    """`difftune X --help` opens with what X does, and says what each option is (8 subcommands had no description
    line; `sample --prompt` repeated the config's text about the prompts drawn at the end of a run)."""
    from difftune.cli import build_parser

    parser = build_parser()
    [commands] = [action for action in parser._actions if isinstance(action, __import__("argparse")._SubParsersAction)]
    assert len(commands.choices) >= 15
    for name, command in commands.choices.items():
        assert command.description and command.description.endswith("."), name
        undocumented = [
            action.option_strings or action.dest
            for action in command._actions
            if not action.help and "--help" not in action.option_strings
        ]
        assert undocumented == [], (name, undocumented)
        with pytest.raises(SystemExit):
            main([name, "--help"])
        shown = capsys.readouterr().out
        assert command.description.split()[0] in shown.split("\n\n")[1], name  # the line after the usage
    prompt = next(action for action in commands.choices["sample"]._actions if "--prompt" in action.option_strings)
    assert "end of training" not in prompt.help
