"""`difftune plan`: the memory plan follows the settings that change memory, the settings it suggests fit and are
the fewest that do, and `difftune train` warns before loading when the plan exceeds the machine. How close the plan
comes to measured peaks is a benchmark (scripts/bench_plan.py, docs/benchmarks.md), not a test."""

from __future__ import annotations

import json
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from difftune.cli import main
from difftune.config import load_config
from difftune.errors import DifftuneError
from difftune.memory.turns import ROOM_TO_COMPUTE
from difftune.models.components import store_loaded_text_encoders
from difftune.models.dtypes import run_dtypes
from difftune.training import plan
from difftune.training.train import train

from conftest import REPO, script_module


def _plan(make_config, **overrides) -> plan.MemoryPlan:
    return plan.plan_memory(make_config(**overrides), "cuda")


def test_the_plan_follows_the_settings_that_change_memory(make_config):
    full = _plan(make_config)
    fp8 = _plan(make_config, model__weight_dtype="fp8")
    # The frozen denoiser: fp8 holds its linear and convolution weights in a byte instead of four.
    assert 0.2 < fp8.device["frozen denoiser weights"] / full.device["frozen denoiser weights"] < 0.35
    assert fp8.device["trained weights"] == full.device["trained weights"] > 0
    assert full.device["optimizer state"] == 2 * full.device["trained weights"]  # AdamW's two moments
    # Offloaded blocks leave the device for the host, byte for byte.
    offloaded = _plan(make_config, model__offload_blocks=5)
    moved = full.device["frozen denoiser weights"] - offloaded.device["frozen denoiser weights"]
    assert moved == offloaded.host_phases["training"]["offloaded blocks"] > 0
    # Activations grow with the batch and the resolution; checkpointing keeps fewer.
    step = "activations and gradients"
    assert 1.6 < _plan(make_config, train__batch_size=4).device[step] / full.device[step] < 2.4
    assert _plan(make_config, data__resolution=64).device[step] > 2 * full.device[step]
    assert _plan(make_config, train__gradient_checkpointing=True).device[step] < full.device[step]
    # Diffusion-DPO holds its chosen and rejected images' activations at once: a batch of twice the size.
    dpo = {"preference__method": "dpo", "adapter__text_encoder": False}
    doubled = _plan(make_config, adapter__text_encoder=False, train__batch_size=4).device[step]
    assert (
        _plan(make_config, **dpo).device[step] == doubled > _plan(make_config, adapter__text_encoder=False).device[step]
    )
    slider = {"slider__positive": "a red circle", "slider__negative": "a blue circle", "adapter__text_encoder": False}
    assert _plan(make_config, **slider).device[step] == doubled  # the LoRA at +1 and at -1
    # Several datasets: planned for the largest resolution trained.
    several = _plan(make_config, data__datasets=[{"path": "a", "resolution": [32, 64]}]).device[step]
    assert several == _plan(make_config, data__resolution=64).device[step]


def test_the_suggested_settings_fit_and_are_the_fewest(make_config):
    config = make_config(data__resolution=64)
    full = plan.plan_memory(config, "cuda")
    fits_as_is = plan.fitting_overrides(config, full.device_peak, None, "cuda")
    assert fits_as_is is not None and fits_as_is[0] == []
    # Just below the full plan: checkpointing alone is the first thing tried, and enough.
    overrides, fitted = plan.fitting_overrides(config, full.device_peak - 1, None, "cuda")
    assert overrides == ["train.gradient_checkpointing=true"] and fitted.device_peak < full.device_peak
    # A budget that needs offloaded blocks: the fewest that fit.
    fp8 = plan.plan_memory(
        make_config(data__resolution=64, train__gradient_checkpointing=True, model__weight_dtype="fp8"), "cuda"
    )
    overrides, fitted = plan.fitting_overrides(config, fp8.device_peak - 1, None, "cuda")
    assert overrides[:2] == ["train.gradient_checkpointing=true", "model.weight_dtype=fp8"]
    count = int(overrides[2].removeprefix("model.offload_blocks="))
    assert fitted.device_peak <= fp8.device_peak - 1
    fewer = plan.plan_memory(
        make_config(
            data__resolution=64,
            train__gradient_checkpointing=True,
            model__weight_dtype="fp8",
            model__offload_blocks=count - 1,
        ),
        "cuda",
    )
    assert fewer.device_peak > fp8.device_peak - 1
    assert plan.fitting_overrides(config, 1000, None, "cuda") is None  # a kilobyte fits nothing


def test_fp8_text_encoders_are_tried_where_caching_the_captions_does_not_fit():
    """HunyuanVideo 1.5's shipped job on a 12 GB GPU: filling the text cache is what does not fit (Qwen2.5-VL 7B's
    language model in bf16 on the GPU); the one setting the plan adds is fp8 text encoders, which hold that model's
    linear layers in a byte a weight (its embeddings and norms in bf16), and training is then the peak."""
    config = load_config(str(REPO / "configs" / "hunyuan_video15_lora.toml"), [])
    budget = 12 * 10**9
    overrides, fitted = plan.fitting_overrides(config, budget, None, "cuda")  # the shipped job's plan does not fit
    assert overrides == ["model.text_encoder_dtype=fp8"]
    assert fitted.device_peak <= budget < fitted.device_caching * 2 and "frozen denoiser weights" in fitted.device
    # As the plan holds them: each linear layer's weight in a byte, every other tensor in bf16.
    fp8 = load_config(str(REPO / "configs" / "hunyuan_video15_lora.toml"), overrides)
    components = plan.empty_components(fp8)
    with torch.device("meta"), plan._counting(1):
        store_loaded_text_encoders(components, run_dtypes(fp8))
    for encoder in components.text_encoders.values():
        linear = sum(m.weight.numel() for m in encoder.modules() if isinstance(m, torch.nn.Linear))
        everything = sum(t.numel() for t in (*encoder.parameters(), *encoder.buffers()))
        assert plan._bytes(encoder, torch.bfloat16) == linear + 2 * (everything - linear)


def test_plan_command_prints_the_plan_and_what_fits(tiny_base, shapes, capsys):
    job = [f"model.base={tiny_base}", f"data.path={shapes}", "data.resolution=32"]
    assert main(["plan", "--device", "cuda", "--json", *job]) == 0
    said = capsys.readouterr()
    result = json.loads(said.out)  # stdout is the JSON line alone; what the plan is doing goes to stderr
    assert result["device_peak"] == sum(result["device"].values()) > 0
    assert result["host"]["python and libraries"] > 0
    assert result["host_peak"] == max(sum(held.values()) for held in result["host_phases"].values())
    assert re.search(r"^difftune: planning the run's memory .*: done in [\d.]+ s", said.err, re.M), said.err
    assert main(["plan", "--device", "cuda", "--device-memory", "1KB", *job]) == 2
    assert "1KB" in capsys.readouterr().err
    assert main(["plan", "--device", "cuda", "--device-memory", "1MB", *job]) == 0
    said = capsys.readouterr()
    # A verdict in words, and a line for each setting tried as the search goes (it was silent for minutes).
    assert "difftune plan: as configured: does not fit in 0.0 GiB GPU, and no setting tried does" in said.out
    tried = re.findall(r"^  (.+): device ([\d.]+) GiB, host ([\d.]+) GiB: (?:device )?too large$", said.err, re.M)
    assert tried[0][0] == "as configured" and "train.gradient_checkpointing=true" in [t[0] for t in tried], said.err
    assert len(tried) >= 3
    device_peak = result["device_peak"] / 2**30
    assert main(["plan", "--device", "cuda", "--device-memory", f"{device_peak * 2:.3f}GiB", *job]) == 0
    said = capsys.readouterr()
    assert re.search(r"^difftune plan: as configured: fits in [\d.]+ GiB GPU$", said.out, re.M), said.out
    assert re.search(r"^  as configured: device [\d.]+ GiB, host [\d.]+ GiB: fits$", said.err, re.M), said.err
    with pytest.raises(DifftuneError, match=r"'12 apples': a size is a number and a unit"):
        plan.parse_size("12 apples")
    assert plan.parse_size("12GB") == 12 * 10**9 and plan.parse_size("1.5 GiB") == 3 * 2**29


def test_train_refuses_before_loading_a_run_the_ram_cannot_hold(make_config, monkeypatch):
    """The OOM killer ended such runs without a word, minutes into loading; the plan refuses them first, naming the
    phase, and the settings that fit where some do; `train.check_memory = false` tries anyway."""
    import difftune.training.train as train_module

    def not_loaded(*args, **kwargs):
        raise AssertionError("the base was loaded")

    config = make_config(train__check_memory=True, train__max_steps=1)
    needed = plan.plan_memory(config, "cpu")
    monkeypatch.setattr(train_module, "load_components", not_loaded)
    monkeypatch.setattr(plan, "_available_bytes", lambda: 10**6)
    with pytest.raises(
        DifftuneError,
        match=r"the memory plan needs [\d.]+ GiB of host RAM while (loading and caching|"
        r"training), and this machine has 0\.00 GiB available: no setting tried "
        r"fits it .*; train\.check_memory = false tries anyway",
    ):
        train(config)
    # With room between the job's peak and its checkpointed one, the refusal names the setting that brings the step
    # within it. Each plan counts what this process holds when it is made: held still here, so that train's plans are
    # the ones this room was measured between (the process's own growth in between once left no room to find).
    held = plan.process_status_bytes("VmRSS")
    monkeypatch.setattr(plan, "process_status_bytes", lambda field: held)
    needed = plan.plan_memory(config, "cpu")
    checkpointed = plan.plan_memory(
        config.model_copy(update={"train": config.train.model_copy(update={"gradient_checkpointing": True})}), "cpu"
    )
    room = (needed.host_peak + checkpointed.host_peak) // 2
    monkeypatch.setattr(plan, "_available_bytes", lambda: room)
    with pytest.raises(
        DifftuneError, match=r"while training, .*: it would fit with train\.gradient_checkpointing=true"
    ):
        train(config)
    monkeypatch.undo()
    monkeypatch.setattr(plan, "_available_bytes", lambda: 10**6)
    assert len(train(make_config(train__check_memory=False, train__max_steps=1)).losses) == 1


def test_inside_plans_remembered_a_config_is_traced_once(make_config, monkeypatch):
    """`difftune plan`, the check before a run and the pages' tables plan the job and then the settings that fit, for
    one budget and the next: inside `plans_remembered` a config planned again (an equal one, another object) is the
    plan traced the first time, counting what the process holds now; a config that differs is traced; outside the
    block each call traces."""
    traced = []
    trace = plan._plan_memory
    monkeypatch.setattr(plan, "_plan_memory", lambda config, device: traced.append(config) or trace(config, device))
    config = make_config()
    with plan.plans_remembered():
        first = plan.plan_memory(config, "cpu")
        monkeypatch.setattr(plan, "process_status_bytes", lambda field: 7 * 2**30)
        again = plan.plan_memory(make_config(), "cpu")
        plan.plan_memory(make_config(train__gradient_checkpointing=True), "cpu")
        with plan.plans_remembered():  # nested: the same plans
            assert plan.plan_memory(config, "cpu").device == first.device
    assert [traced_config.train.gradient_checkpointing for traced_config in traced] == [False, True]
    assert again.device == first.device and again.device_caching == first.device_caching
    for phase, held in first.host_phases.items():
        assert again.host_phases[phase] == held | {"python and libraries": 7 * 2**30}
    assert again.host_peak == max(sum(held.values()) for held in again.host_phases.values())
    plan.plan_memory(config, "cpu")
    assert len(traced) == 3


def test_an_offload_budget_offloads_the_fewest_blocks_that_fit(make_config, capsys):
    count = plan._block_count(make_config())
    whole, everything = _plan(make_config), _plan(make_config, model__offload_blocks=count)
    text = f"{(whole.device_peak + everything.device_peak) / 2 / 10**6}MB"
    budget = plan.parse_size(text)
    blocks = plan.with_offload_budget(make_config(model__offload_budget=text)).model.offload_blocks
    assert 0 < blocks < count
    assert _plan(make_config, model__offload_blocks=blocks).device_peak <= budget
    assert _plan(make_config, model__offload_blocks=blocks - 1).device_peak > budget
    # The plan of a budgeted job is the plan of the count it resolves to.
    assert (
        _plan(make_config, model__offload_budget=text).device == _plan(make_config, model__offload_blocks=blocks).device
    )
    fits_whole = f"{whole.device_peak / 10**6 + 1}MB"
    assert plan.with_offload_budget(make_config(model__offload_budget=fits_whole)).model.offload_blocks == 0
    with pytest.raises(DifftuneError, match=rf'offload_budget = "1MB": with all {count} blocks offloaded the plan'):
        plan.with_offload_budget(make_config(model__offload_budget="1MB"))
    # The run offloads what the plan said, and its resolved config records the count.
    config = make_config(model__offload_budget=text, train__max_steps=1)
    train(config)
    assert f"model.offload_budget {text}: the memory plan offloads {blocks} blocks" in capsys.readouterr().out
    resolved = load_config(Path(config.train.output_dir) / "config.toml")
    assert (resolved.model.offload_blocks, resolved.model.offload_budget) == (blocks, "")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model__offload_budget": "12 apples"}, r"offload_budget[\s\S]*'12 apples': a size is a number and a unit"),
        ({"model__offload_budget": "12GB", "model__offload_blocks": 2}, "both say how many blocks to offload: set one"),
        (
            {"model__offload_budget": "12GB", "adapter__kind": "none"},
            r'offload_budget = "12GB" may keep frozen weights in host memory, and a full fine-tune has none',
        ),
    ],
)
def test_an_offload_budget_that_cannot_apply_is_refused(make_config, overrides, message):
    with pytest.raises(DifftuneError, match=message):
        make_config(**overrides)


def test_cached_encoders_leave_the_device(make_config):
    previews = dict(sample__prompts=["a red circle"], sample__every_steps=2)
    cached = dict(cache__latents=True, cache__text=True)
    every_step = _plan(make_config, **previews)  # encoded every step: on the device
    waiting = _plan(make_config, **previews, **cached)  # cached, needed by the previews: in host memory
    released = _plan(make_config, **cached)  # cached, needed by nothing: dropped until the end of the run
    encoders = every_step.device["encoders kept on the device"]

    def kept_on_host(planned: plan.MemoryPlan) -> int:
        return planned.host_phases["training"]["encoders kept for previews"]

    assert encoders > 0 and kept_on_host(every_step) == 0
    assert waiting.device["encoders kept on the device"] == 0 and kept_on_host(waiting) == encoders
    assert released.device["encoders kept on the device"] == kept_on_host(released) == 0


def test_the_caches_fill_one_encoder_kind_at_a_time(monkeypatch):
    """The autoencoder leaves the device before the text encoders come to cache the captions (train.py), so the
    caching phase holds the text encoders alone where they are the larger (Kandinsky 5's Qwen2.5-VL 7B and CLIP-L),
    not the autoencoder beside them."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = load_config(REPO / "configs" / "kandinsky5_1024_lora.toml")
    planned = plan.plan_memory(config, "cuda")
    components = plan.empty_components(config)
    text = sum(
        t.numel() * 2 for m in components.text_encoders.values() for t in (*m.parameters(), *m.buffers())
    )  # bf16, as the job loads them
    vae = sum(p.numel() * 2 for p in components.vae.parameters())
    assert planned.device["encoders (caching)"] == pytest.approx(text, rel=0.01)
    assert planned.device["encoders (caching)"] < text + vae / 2


def test_alike_blocks_are_bisected_to_the_count_each_count_tried_finds(make_config, monkeypatch):
    job = dict(model__base=str(REPO / "models" / "tiny-qwen_image"), data__resolution=64)
    peaks = [_plan(make_config, **job, model__offload_blocks=count).device_peak for count in range(5)]
    assert peaks == sorted(peaks, reverse=True)  # a transformer's alike blocks: fewer bytes for each one offloaded
    budget = f"{(peaks[2] + peaks[3]) / 2 / 10**6}MB"
    tried = plan.with_offload_budget(make_config(**job, model__offload_budget=budget)).model.offload_blocks
    monkeypatch.setattr(plan, "FEW_BLOCKS", 0)
    bisected = plan.with_offload_budget(make_config(**job, model__offload_budget=budget)).model.offload_blocks
    assert tried == bisected == 3


# Plans before the download: the published bases' configs kept in difftune (difftune/published).

# Parameters of the published models, as their model cards and papers give them (billions, within 2%, or with the
# tolerance their rounding needs: "14B", "4B"): a kept config that differs from the published one builds another size.
PUBLISHED_SIZES = {
    "stable-diffusion-v1-5/stable-diffusion-v1-5": {"unet": 0.86, "text_encoder": 0.123},
    "stabilityai/stable-diffusion-xl-base-1.0": {"unet": 2.567, "text_encoder_2": 0.695},
    "stabilityai/stable-diffusion-3.5-large": {"transformer": 8.1},
    "black-forest-labs/FLUX.1-dev": {"transformer": 11.9, "text_encoder_2": 4.76},
    "lodestones/Chroma1-HD": {"transformer": 8.9},
    "black-forest-labs/FLUX.2-dev": {"transformer": 32.0, "text_encoder": 24.0},
    "black-forest-labs/FLUX.2-klein-4B": {"transformer": (4.0, 0.04), "text_encoder": 4.0},
    "Qwen/Qwen-Image": {"transformer": 20.4, "text_encoder": 8.29},
    # Qwen-Image's 20B transformer with its RGBA time condition (the layered model's card: "based on Qwen-Image")
    "Qwen/Qwen-Image-Layered": {"transformer": (20.4, 0.02)},
    "Tongyi-MAI/Z-Image-Turbo": {"transformer": 6.15},
    "Alpha-VLLM/Lumina-Image-2.0": {"transformer": 2.6, "text_encoder": 2.61},
    "HiDream-ai/HiDream-I1-Full": {"transformer": 17.1, "text_encoder_4": 8.03},
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": {"transformer": (14.0, 0.03)},
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": {"transformer": 1.4},
    # "an 8B DiT backbone" (diffusers' page); Ministral 3 3B with its vision tower, "~3.8B" (DiffSynth-Studio's table)
    "baidu/ERNIE-Image": {"transformer": (8.0, 0.03), "text_encoder": (3.8, 0.03)},
    # Qwen3-VL 8B with its vision tower (8.77B on its model card); the transformer's size is not published
    "Qwen/Qwen-Image-2.1": {"text_encoder": 8.77},
    # Qwen3-VL 4B with its vision tower (4.44B on its model card); FLUX.3's transformer's size is not published
    "black-forest-labs/FLUX.3-dev": {"text_encoder": 4.44},
    # Cosmos-Predict2 2B's DiT ("2B"); Qwen3 0.6B (0.6B on its model card)
    "circlestone-labs/Anima-Base-v1.0-Diffusers": {"transformer": (2.0, 0.03), "text_encoder": 0.6},
    # Kandinsky 5.0 Image Lite: "6B" (its model card); Qwen2.5-VL 7B as Qwen-Image's
    "kandinskylab/Kandinsky-5.0-T2I-Lite-sft-Diffusers": {"transformer": (6.0, 0.03), "text_encoder": 8.29},
    "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers": {"transformer": (2.0, 0.03)},  # "Video Lite, 2B"
    # "a 17B text-to-image model" (diffusers' page); ByT5-small's encoder, 218M (its 300M less the 4-layer decoder)
    "hunyuanvideo-community/HunyuanImage-2.1-Diffusers": {"transformer": (17.0, 0.03), "text_encoder_2": (0.218, 0.03)},
    # "8.3B parameters" (HunyuanVideo 1.5's model card); Qwen2.5-VL 7B's language model alone, without its output head:
    # Qwen2.5-7B's 7.61B (its model card) less 152064 x 3584
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v": {"transformer": (8.3, 0.03), "text_encoder": 7.065},
    # HunyuanVideo 1.5 I2V's image encoder: SigLIP so400m's vision tower, SoViT-400m/14, 428M ("Getting ViT in Shape")
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v": {"image_encoder": (0.428, 0.03)},
    # "a 19B" audio-video DiT (Lightricks' model card, its 14B video and 5B audio streams); Gemma 3 12B with its vision
    # tower (12.2B, Gemma 3's technical report)
    "Lightricks/LTX-2": {"transformer": 19.0, "text_encoder": 12.2},
    # Wan 2.1 I2V's image encoder: open_clip's ViT-H/14 vision tower, 632M (open_clip's model table)
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": {"image_encoder": 0.632},
}


@pytest.mark.parametrize("base", sorted(PUBLISHED_SIZES))
def test_a_kept_base_builds_the_published_model(base):
    """Each part built from the kept configs on the meta device has the published model's size (within 2%), and the
    base is read as its family without asking the hub."""
    from difftune import published
    from difftune.config import Config, ModelConfig

    components = plan.empty_components(Config(model=ModelConfig(base=base)))
    parts = {components.family.denoiser_name: components.denoiser, **components.text_encoders}
    parts |= components.pixel_encoders
    for part, published_size in PUBLISHED_SIZES[base].items():
        billions, tolerance = published_size if isinstance(published_size, tuple) else (published_size, 0.02)
        size = sum(p.numel() for p in parts[part].parameters()) / 1e9
        assert size == pytest.approx(billions, rel=tolerance), (part, size)
    assert published.reference_bases()[components.family.name] in published.published_bases()


def test_every_family_has_a_kept_reference_base():
    from difftune import published
    from difftune.families import FAMILIES

    assert set(published.reference_bases()) == set(FAMILIES)
    assert set(published.reference_bases().values()) <= set(published.published_bases())


def _configs_naming_bases_not_here() -> list[Path]:
    """The shipped configs whose base is not on this machine: a hub id, or a folder still to be made."""
    found = []
    for path in sorted((REPO / "configs").glob("*.toml")):
        config = load_config(path)
        if not Path(config.model.base).exists():
            found.append(path)
    return found


@pytest.mark.every_config  # outside CI's 45 minutes since 30 families' configs took 5 of them; each family's page
# shows its config's plan (scripts/plan_table.py), and the plan tests below plan the shipped Qwen-Image one in CI.
def test_every_shipped_config_is_planned_offline(monkeypatch):
    """Every shipped config for a base not here (the 1024 px ones among them) is planned with the hub unreachable:
    from the base's kept configs, or its family's reference base for a folder still to be made; the plan says which.
    Two at a time, each in a process of its own (inheriting the offline switch): a large model's plan is seconds of
    one core's work, and CI has two."""
    from difftune import published

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    configs = {path.name: load_config(path) for path in _configs_naming_bases_not_here()}
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        planning = {name: pool.submit(plan.plan_memory, config, "cuda") for name, config in configs.items()}
        for name, config in configs.items():
            try:
                predicted = planning[name].result()
            except Exception as err:
                raise AssertionError(f"configs/{name}: {err}") from err
            assert predicted.device_peak > 2**30 and predicted.host_peak > predicted.host["python and libraries"], name
            base = config.model.base
            kept = base if published.is_published(base) else published.reference_bases()[config.model.family]
            assert predicted.configs.startswith(f"{kept}'s, kept in difftune"), name


@pytest.mark.slow
def test_the_plan_command_answers_for_qwen_image_before_the_download(monkeypatch, capsys):
    """`difftune plan --config configs/qwen_image_1024_lora.toml --device-memory 80GB --host-memory 128GB`, offline: it
    used to stop on "Qwen/Qwen-Image has no model_index.json". A GPU's memory asked about, it plans for a GPU. (A
    budget the job fits as shipped: the fitting ladder's other settings are tested on their own, and at 20B each plan
    it tries costs CI seconds.)"""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert (
        main(
            [
                "plan",
                "--config",
                str(REPO / "configs/qwen_image_1024_lora.toml"),
                "--device-memory",
                "80GB",
                "--host-memory",
                "128GB",
                "--json",
            ]
        )
        == 0
    )
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert answer["configs"] == "Qwen/Qwen-Image's, kept in difftune (nothing downloaded)"
    assert answer["device_type"] == "cuda"
    # The transformer's 20.4B weights in bf16 are what the device holds most of (fp8 halves them).
    assert answer["device"]["frozen denoiser weights"] == pytest.approx(20.43e9 * 2, rel=0.01)
    assert answer["fits_with"] == []


def test_a_base_neither_here_nor_kept_is_refused_naming_what_to_do(make_config):
    config = make_config(model__base="someone/some-model")
    with pytest.raises(
        DifftuneError,
        match=r"someone/some-model is neither a local pipeline folder nor a base whose "
        r"configs difftune keeps \(.*Qwen/Qwen-Image.*\); set model.family",
    ):
        plan.empty_components(config)


def test_a_single_file_without_its_folder_is_planned_as_its_familys_published_model(tmp_path, make_config):
    """A FLUX.1 single file (BFL's layout, as ComfyUI's users have it) and no config folder: the plan reads the file's
    keys for its family and plans FLUX.1-dev's published configs, saying so (it used to stop, asking for a folder)."""
    from safetensors.torch import save_file

    from difftune.config import ModelConfig
    from difftune.families import FAMILIES, load_components

    tiny = REPO / "models" / "tiny-flux"
    save_file(
        FAMILIES["flux"].layout.to_single_file(load_components(ModelConfig(base=str(tiny)))),
        tmp_path / "flux.safetensors",
    )
    config = make_config(model__base=str(tmp_path / "flux.safetensors"))
    assert plan.configs_read(config.model).startswith(
        "black-forest-labs/FLUX.1-dev's, kept in difftune: the flux family's reference base"
    )
    components = plan.empty_components(config)
    assert sum(p.numel() for p in components.denoiser.parameters()) == pytest.approx(11.9e9, rel=0.01)


def test_the_host_plan_follows_the_runs_phases(make_config):
    """Filling the caches first, the run never holds the encoders beside the denoiser: the plan's loading phase holds
    the encoders alone, and the denoiser loads in a phase of its own, stored as the run stores it (fp8: a byte a
    weight). Drawing "before" samples needs the whole base at once: one loading phase holds it all."""
    cached = dict(cache__latents=True, cache__text=True, adapter__text_encoder=False, sample__prompts=["a red circle"])
    first = _plan(make_config, sample__before=False, **cached)
    whole = _plan(make_config, sample__before=True, **cached)
    assert list(first.host_phases) == ["loading and caching", "loading the denoiser", "training", "end of run samples"]
    assert list(whole.host_phases) == ["loading and caching", "training", "end of run samples"]
    # At the end, the released encoders come back for the samples (on a GPU they pass through the host).
    assert first.host_phases["end of run samples"]["encoders"] == first.host_phases["loading and caching"]["encoders"]
    denoiser = first.host_phases["loading the denoiser"]["denoiser"]
    assert (
        whole.host_phases["loading and caching"]["whole base"] - first.host_phases["loading and caching"]["encoders"]
        == denoiser
        > 0
    )
    assert first.host_peak == max(sum(held.values()) for held in first.host_phases.values())
    fp8 = _plan(make_config, sample__before=False, model__weight_dtype="fp8", **cached)
    stored = fp8.host_phases["loading the denoiser"]["denoiser"]
    assert denoiser / 4 < stored < denoiser / 2  # fp32 weights, a quarter in fp8 (norms and biases as they were)


def test_the_host_memory_bench_reads_each_phase_from_the_runs_lines():
    """scripts/bench_host_memory.py compares the plan's phases with the run's own phase lines: each plan phase takes
    the highest peak among the lines that make it up (the last checkpoint's write, between training and saving, is
    in the training phase)."""
    bench = script_module("bench_host_memory")
    lines = """difftune: loading the encoders of the base /x: done in 1.7 s, host peak 612 MiB
difftune: reading the data in /d: done in 0.0 s, host peak 612 MiB
difftune: filling the caches: done in 20.9 s, host peak 10.3 GiB
difftune: loading the transformer: done in 1 min 34 s, host peak 12.0 GiB
difftune: preparing the model for training: done in 29.8 s, host peak 12.0 GiB
difftune: training: done in 6 min 08 s, host peak 13.3 GiB
difftune: saving the result: done in 1.2 s, host peak 13.8 GiB
difftune: parity: 0 levels in both layouts"""
    assert bench.measured_phases(lines) == {
        "loading and caching": round(10.3 * 2**30),
        "loading the denoiser": round(12.0 * 2**30),
        "training": round(13.8 * 2**30),
    }
    assert bench.measured_phases(lines, "device_") == {}  # a CPU run's lines say no device peak
    # A CUDA run's lines (an H200's, docs/benchmarks.md) add the device's peak, read as the host's is.
    on_cuda = """difftune: filling the caches: done in 13.6 s, host peak 10.8 GiB, device peak 9.1 GiB
difftune: loading the transformer: done in 15.1 s, host peak 13.5 GiB, device peak 33 MiB
difftune: training: done in 9.9 s, host peak 4.7 GiB, device peak 14.6 GiB
difftune: saving the result: done in 1.1 s, host peak 4.8 GiB, device peak 12.6 GiB"""
    assert bench.measured_phases(on_cuda, "device_") == {
        "loading and caching": round(9.1 * 2**30),
        "loading the denoiser": 33 * 2**20,
        "training": round(14.6 * 2**30),
    }
    assert bench.measured_phases(on_cuda)["training"] == round(4.8 * 2**30)


def test_a_layout_of_constants_keeps_its_values_on_the_meta_device():
    """A model that lays out its sequence by a mask (Qwen-Image 2.1's `img_mask`, expanded by `repeat_interleave`) is
    planned with that layout's shapes: small boolean and integer tensors made of constants keep their values on the
    meta device; one written in place forgets them (a count of it is then the plan's upper bound, `full`, or the
    mask's size where that is less)."""
    text = torch.ones(2, 5, dtype=torch.bool, device="meta")  # a mask of unknown values
    with plan._counting(7):
        slots = torch.cat([text.new_zeros(text.shape), text.new_ones(2, 3)], dim=1)
        repeats = torch.where(slots, 4, 1)[0]
        hidden = torch.zeros(2, 8, 16, device="meta").repeat_interleave(repeats, dim=1)
        assert hidden.shape == (2, 5 + 3 * 4, 16)
        assert torch.repeat_interleave(slots[0], repeats).nonzero().shape == (12, 1)
        assert int(slots.sum()) == 6
        slots[:, 0] = True  # written in place: its values are no longer known
        assert int(slots.sum()) == 7
        assert int(text.sum()) == 7  # never known
        # A count is at most what it counts: Qwen-Image 2.1's text before a 32 px image (4 tokens) is shorter than
        # the longest caption the plan reads with the template around it, and the model lists that many positions.
        assert int(text[:, :3].sum()) == 6 and int((~text[0]).sum()) == 5


def _step_peak(make_config, **overrides) -> int:
    """The plan's peak of one training step alone (the activations and gradients entry is the larger of it and the
    encoders', which a micro base's step does not reach)."""
    config = make_config(**overrides)
    return plan._step_peak(plan.empty_components(config), config, torch.float32)[0]


def test_a_steps_control_tokens_are_planned(micro_base, make_config, monkeypatch):
    """An edit base's step reads its control's tokens beside the image's, a layered base's its layers' and the image's:
    the plan's step holds them (it held the image's alone), and a layered base's grows with its layers."""
    from difftune.families import FAMILIES

    # At 128 px an image is 256 tokens, about what the micro bases' captions are: a control's tokens show.
    kontext = {"model__base": str(micro_base("flux_kontext")), "train__batch_size": 1, "data__resolution": 128}
    planned = _step_peak(make_config, **kontext)
    with monkeypatch.context() as patched:
        patched.setattr(FAMILIES["flux_kontext"].conditioning, "planned_controls", lambda components, latents: [])
        alone = _step_peak(make_config, **kontext)
    assert planned > 1.3 * alone, (planned, alone)
    layered = {"model__base": str(micro_base("qwen_image_layered")), "train__batch_size": 1, "data__resolution": 128}
    two, four = (_step_peak(make_config, **layered, model__family_options={"layers": n}) for n in (2, 4))
    assert four > 1.3 * two, (four, two)


def test_a_plan_is_kept_between_runs_for_the_same_settings_and_base(make_config, tiny_base, tmp_path, monkeypatch):
    # A run re-run (or resumed) with the same settings reads its plan instead of tracing a step again; a setting the
    # plan reads, the base's configs, or a file that is not a plan mean a fresh trace. The length of the run does not.
    import shutil

    monkeypatch.setenv("DIFFTUNE_PLAN_CACHE", "on")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    traced, trace = [], plan._plan_memory
    monkeypatch.setattr(plan, "_plan_memory", lambda *args: traced.append(args) or trace(*args))
    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    first = plan.plan_memory(make_config(**{"model.base": str(base)}), "cuda")
    again = plan.plan_memory(make_config(**{"model.base": str(base), "train.max_steps": 50}), "cuda")
    assert len(traced) == 1 and (again.device, again.host_phases.keys()) == (first.device, first.host_phases.keys())
    (kept,) = (tmp_path / "cache" / "difftune" / plan.PLANS_FOLDER).iterdir()
    bigger = plan.plan_memory(make_config(**{"model.base": str(base), "train.batch_size": 4}), "cuda")
    assert len(traced) == 2 and bigger.device_peak > first.device_peak
    unet, published = base / "unet" / "config.json", (base / "unet" / "config.json").read_text()
    unet.write_text(json.dumps(json.loads(published) | {"layers_per_block": 2}))
    plan.plan_memory(make_config(**{"model.base": str(base)}), "cuda")
    kept.write_text("{not a plan")
    assert len(traced) == 3
    unet.write_text(published)
    plan.plan_memory(make_config(**{"model.base": str(base)}), "cuda")  # its kept file unreadable: traced, kept anew
    assert len(traced) == 4 and json.loads(kept.read_text())["device"] == first.device


def test_prompts_read_by_turns_count_the_denoiser_waiting_in_host_memory(make_config):
    """A run whose captions are cached reads its sample prompts with the text encoders brought from host memory
    (turns.py): on a GPU that cannot hold them beside the training state, the denoiser's frozen and trained weights
    wait in host memory meanwhile, in the phases that draw (the end samples; the training phase too where previews or
    validation read prompts); on one that can, nothing is added. Text encoders kept on the device take no turns."""
    job = dict(
        model__base=str(REPO / "models" / "tiny-qwen_image"),
        data__resolution=64,
        cache__latents=True,
        cache__text=True,
        sample__prompts=["a purple circle"],
    )
    planned = _plan(make_config, **job)
    assert planned.prompts_read > 0 and planned.denoiser_waiting > 0
    assert tuple(planned.drawing_phases) == ("end of run samples",)
    enough = planned.device_training + planned.prompts_read + ROOM_TO_COMPUTE
    assert plan.on_a_device_of(planned, enough) == planned
    short = plan.on_a_device_of(planned, enough - 1)
    end = short.host_phases["end of run samples"]
    assert end["denoiser (waiting while prompts are read)"] == planned.denoiser_waiting
    assert short.host_peak == max(sum(held.values()) for held in short.host_phases.values()) >= sum(end.values())
    assert short.host_phases["training"] == planned.host_phases["training"]

    previews = _plan(make_config, **job, sample__every_steps=10)
    assert tuple(previews.drawing_phases) == ("training", "end of run samples")
    kept = _plan(make_config, **job | {"cache__text": False})
    assert kept.drawing_phases == () and plan.on_a_device_of(kept, 1) == kept
