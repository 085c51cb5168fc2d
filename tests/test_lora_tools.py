"""`difftune resize` and `difftune extract`: LoRAs re-factored at a lower rank, and taken out of a full fine-tune,
checked against the SVD of each layer's change (computed here on the full matrix) and read back by diffusers' own
kohya reader."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import StableDiffusionPipeline
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from difftune.adapters import export
from difftune.adapters.extract import extract_lora
from difftune.adapters.files import module_names_of, read_adapter
from difftune.adapters.trained import adapter_scale, derived_lora_configs
from difftune.cli import main
from difftune.config import FAMILY_NAMES, ModelConfig
from difftune.families import load_components

from conftest import comfyui_applies_as

RANK, ALPHA = 8, 4.0
MODULES = {
    "unet": ["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q", "down_blocks.0.resnets.0.conv1"],
    "text_encoder": [f"encoder.layers.0.self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "out_proj")],
}


def _lora(tiny_base, path, layout: str = "kohya", dora: bool = False):
    """A rank-8, alpha-4 LoRA on a linear and a 3x3 convolution of the UNet and a text-encoder layer's attention
    (diffusers' kohya reader takes a CLIP layer's attention whole), each change's
    singular values falling by half a rank (so a norm share picks a rank), written as difftune writes `layout`."""
    components = load_components(ModelConfig(base=str(tiny_base)))
    models = {"unet": components.denoiser, "text_encoder": components.text_encoders["text_encoder"]}
    generator = torch.Generator().manual_seed(0)
    falling = 2.0 ** -torch.arange(RANK, dtype=torch.float32)
    tensors = {}
    for part, modules in MODULES.items():
        layers = dict(models[part].named_modules())
        for module in modules:
            weight = layers[module].weight
            kernel = weight.shape[2:]
            down = torch.randn(RANK, weight.shape[1], *kernel, generator=generator)
            up = torch.randn(weight.shape[0], RANK, *(1,) * len(kernel), generator=generator)
            tensors[f"{part}.{module}.lora_A.weight"] = down
            tensors[f"{part}.{module}.lora_B.weight"] = up * falling.reshape(1, RANK, *(1,) * len(kernel))
            if dora:
                tensors[f"{part}.{module}.lora_magnitude_vector"] = weight.detach().flatten(1).norm(dim=1)
    ranks = {part: dict.fromkeys(modules, RANK) for part, modules in MODULES.items()}
    alphas = {part: dict.fromkeys(modules, ALPHA) for part, modules in MODULES.items()}
    configs = derived_lora_configs(ranks, alphas, dict.fromkeys(MODULES, dora))
    return export.write_adapter(path, tensors, configs, "", layout, base=str(tiny_base))


def _changes(path, tiny_base) -> dict[str, torch.Tensor]:
    """Each module's change (scale x up @ down, as a matrix) of a file, read as difftune reads any file."""
    tensors, configs, _ = export.read_any_adapter(path, str(tiny_base))
    changes = {}
    for key in [key for key in tensors if key.endswith(".lora_A.weight")]:
        part, _, module = key.removesuffix(".lora_A.weight").partition(".")
        down, up = tensors[key].flatten(1).double(), tensors[key.replace("lora_A", "lora_B")].flatten(1).double()
        changes[f"{part}.{module}"] = adapter_scale(configs, part, module, down.shape[0]) * up @ down
    return changes


def test_a_full_rank_resize_keeps_the_change_and_diffusers_reads_it_alike(tiny_base, tmp_path):
    """At the file's own rank the change is the same, in the kohya layout it came in (alpha = rank now: the scale is
    in the factors), and diffusers' kohya reader applies both files alike."""
    source = _lora(tiny_base, tmp_path / "source.safetensors")
    target = tmp_path / "resized.safetensors"
    assert main(["resize", str(source), str(target), "--rank", str(RANK), "--base", str(tiny_base)]) == 0
    before, after = _changes(source, tiny_base), _changes(target, tiny_base)
    assert before.keys() == after.keys() and len(after) == 6
    for module, change in before.items():
        torch.testing.assert_close(after[module], change, rtol=1e-5, atol=1e-5)
    resized, configs, _ = export.read_any_adapter(target, str(tiny_base))
    assert configs["unet.r"] == configs["unet.lora_alpha"] == RANK
    outputs = []
    for path in (source, target):
        pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, dtype=torch.float32)
        pipeline.load_lora_weights(str(path))
        latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
        text = pipeline.text_encoder(torch.tensor([[1, 5, 9, 2]]))[0]
        outputs.append(pipeline.unet(latents, 500, text).sample)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)


def test_a_lower_rank_is_the_best_change_of_that_rank(tiny_base, tmp_path):
    """At rank 3 each layer's error is the singular values it dropped (Eckart-Young: no rank-3 change is closer),
    computed here by an SVD of the full change; the report says the norm each layer kept."""
    source = _lora(tiny_base, tmp_path / "source.safetensors", layout="diffusers")
    target, report = tmp_path / "r3.safetensors", tmp_path / "report.json"
    assert main(["resize", str(source), str(target), "--rank", "3", "--report", str(report)]) == 0
    before, after = _changes(source, tiny_base), _changes(target, tiny_base)
    rows = {row["module"]: row for row in json.loads(report.read_text())}
    for module, change in before.items():
        singular = torch.linalg.svdvals(change)
        dropped = singular[3:].square().sum().sqrt()
        assert torch.linalg.matrix_norm(change - after[module]) == pytest.approx(float(dropped), rel=1e-6)
        kept = float(singular[:3].square().sum().sqrt() / singular.square().sum().sqrt())
        assert (rows[module]["rank_before"], rows[module]["rank_after"]) == (RANK, 3)
        assert rows[module]["kept"] == pytest.approx(kept, rel=1e-6)
    tensors, _, _ = read_adapter(target)
    assert {tensor.shape[0] for key, tensor in tensors.items() if key.endswith("lora_A.weight")} == {3}


def test_a_norm_share_keeps_the_fewest_ranks_that_hold_it(tiny_base, tmp_path):
    """--keep-fro 0.9: each layer keeps the fewest ranks whose singular values hold 0.9 of its change's norm (one
    fewer would not), within --rank where both are given."""
    source = _lora(tiny_base, tmp_path / "source.safetensors", layout="diffusers")
    target, report = tmp_path / "fro.safetensors", tmp_path / "report.json"
    assert main(["resize", str(source), str(target), "--keep-fro", "0.9", "--report", str(report)]) == 0
    for row in json.loads(report.read_text()):
        singular = torch.linalg.svdvals(_changes(source, tiny_base)[row["module"]])
        share = (singular.square().cumsum(0) / singular.square().sum()).sqrt()
        k = row["rank_after"]
        assert share[k - 1] >= 0.9 and (k == 1 or share[k - 2] < 0.9), (row, share)
        assert row["kept"] == pytest.approx(float(share[k - 1]), rel=1e-6)
    capped = tmp_path / "capped.safetensors"
    assert main(["resize", str(source), str(capped), "--keep-fro", "0.999", "--rank", "2"]) == 0
    tensors, _, _ = read_adapter(capped)
    assert {tensor.shape[0] for key, tensor in tensors.items() if key.endswith("lora_A.weight")} == {2}


@pytest.mark.parametrize(
    "arguments, message",
    [
        ([], "give --rank"),
        (["--rank", "0"], "--rank 0: a rank is 1 or more"),
        (["--keep-fro", "1.5"], "--keep-fro 1.5: a share"),
    ],
)
def test_a_resize_without_a_rank_or_share_is_refused(tiny_base, tmp_path, capsys, arguments, message):
    source = _lora(tiny_base, tmp_path / "source.safetensors", layout="diffusers")
    target = tmp_path / "resized.safetensors"
    assert main(["resize", str(source), str(target), *arguments]) != 0
    assert message in capsys.readouterr().err and not target.exists()


def test_a_dora_is_refused_by_name(tiny_base, tmp_path, capsys):
    source = _lora(tiny_base, tmp_path / "dora.safetensors", layout="diffusers", dora=True)
    target = tmp_path / "resized.safetensors"
    assert main(["resize", str(source), str(target), "--rank", "4"]) != 0
    assert "text_encoder: a dora adapter; resize re-factors a LoRA" in capsys.readouterr().err and not target.exists()


CHANGED = {
    "unet": ["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q", "down_blocks.0.resnets.0.conv1"],
    "text_encoder": [f"encoder.layers.0.self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "out_proj")],
}


@pytest.fixture(scope="module")
def fine_tune(tiny_base, tmp_path_factory):
    """The micro SD base with a rank-3 change added to a UNet linear, a 3x3 convolution and a CLIP layer's attention
    (a full fine-tune's result, saved as a pipeline folder): (folder, {part.module: the change as a matrix})."""
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, dtype=torch.float32)
    models = {"unet": pipeline.unet, "text_encoder": pipeline.text_encoder}
    generator = torch.Generator().manual_seed(3)
    changes = {}
    with torch.no_grad():
        for part, modules in CHANGED.items():
            layers = dict(models[part].named_modules())
            for module in modules:
                weight = layers[module].weight
                change = torch.randn(weight.shape[0], 3, generator=generator) @ torch.randn(
                    3, weight[0].numel(), generator=generator
                )
                weight += 0.05 * change.reshape(weight.shape)
                changes[f"{part}.{module}"] = 0.05 * change.double()
    folder = tmp_path_factory.mktemp("fine-tune")
    pipeline.save_pretrained(folder, safe_serialization=True)
    return folder, changes


def test_an_extracted_lora_is_the_fine_tunes_difference_and_diffusers_reads_it_so(tiny_base, fine_tune, tmp_path):
    """At a rank over the changes' own (3), the changed layers alone are extracted, each exactly its change; read by
    diffusers' kohya reader onto the base, the UNet predicts what the fine-tuned UNet predicts."""
    folder, changes = fine_tune
    out, report = tmp_path / "extracted.safetensors", tmp_path / "report.json"
    arguments = ["extract", "--base", str(tiny_base), "--tuned", str(folder), "--out", str(out), "--rank", "8"]
    arguments.append("--all-layers")  # the convolution too, which SD's LoRAs leave out by default
    assert main([*arguments, "--to", "kohya", "--report", str(report)]) == 0
    extracted = _changes(out, tiny_base)
    assert extracted.keys() == changes.keys()
    for module, change in changes.items():
        torch.testing.assert_close(extracted[module], change.flatten(1), rtol=1e-4, atol=1e-6)
    assert {(row["rank_before"], row["rank_after"]) for row in json.loads(report.read_text())} == {(3, 3)}
    outputs = []
    for path, adapter in ((tiny_base, out), (folder, None)):
        pipeline = StableDiffusionPipeline.from_pretrained(path, dtype=torch.float32)
        if adapter:
            pipeline.load_lora_weights(str(adapter))
        latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
        text = pipeline.text_encoder(torch.tensor([[1, 5, 9, 2]]))[0]
        outputs.append(pipeline.unet(latents, 500, text).sample)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)
    # Without --all-layers, the layers SD's LoRAs adapt: the attention, not the convolution.
    assert main(arguments[:-1]) == 0
    assert _changes(out, tiny_base).keys() == changes.keys() - {"unet.down_blocks.0.resnets.0.conv1"}


def test_an_extracted_kohya_file_is_applied_by_comfyuis_key_maps_as_the_fine_tune(tiny_base, fine_tune, tmp_path):
    """ComfyUI's key maps (`comfyui_lora.py`, over the original single-file layout it holds the UNet in) reach every
    key of an extracted kohya file, the UNet's and CLIP's alike, and its formula turns the base into the fine-tune."""
    folder, _ = fine_tune
    out = tmp_path / "extracted.safetensors"
    arguments = ["extract", "--base", str(tiny_base), "--tuned", str(folder), "--out", str(out), "--rank", "8"]
    assert main([*arguments, "--all-layers", "--to", "kohya"]) == 0
    lora = load_file(out)
    assert any(key.startswith("lora_te_") for key in lora) and any(key.startswith("lora_unet_") for key in lora)
    base, tuned = (load_components(ModelConfig(base=str(path))) for path in (tiny_base, folder))
    assert comfyui_applies_as(lora, base, tuned)


def test_an_extraction_at_a_lower_rank_is_the_best_of_that_rank(tiny_base, fine_tune, tmp_path):
    """At rank 2 each layer's error is the singular values of its change it dropped (an SVD here of the change)."""
    folder, changes = fine_tune
    out = tmp_path / "r2.safetensors"
    arguments = ["extract", "--base", str(tiny_base), "--tuned", str(folder), "--out", str(out), "--rank", "2"]
    assert main([*arguments, "--all-layers"]) == 0
    extracted = _changes(out, tiny_base)
    for module, change in changes.items():
        matrix = change.flatten(1)
        dropped = torch.linalg.svdvals(matrix)[2:].square().sum().sqrt()
        assert torch.linalg.matrix_norm(matrix - extracted[module]) == pytest.approx(float(dropped), rel=1e-5)


def test_an_extraction_from_another_model_or_no_change_is_refused(tiny_base, tiny_sdxl_base, tmp_path, capsys):
    out = tmp_path / "extracted.safetensors"
    for tuned, message in (
        (tiny_sdxl_base, "give the base the fine-tune started from"),
        (tiny_base, "no layer of the fine-tuned model differs from the base"),
    ):
        assert main(["extract", "--base", str(tiny_base), "--tuned", str(tuned), "--out", str(out), "--rank", "4"])
        assert message in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_familys_fine_tune_extracts_into_both_layouts(family, micro_base, tmp_path):
    """Each family's micro base with every adaptable layer moved: the extracted LoRA holds the layers a LoRA of the
    family adapts (its targets, in the parts its pipeline's LoRA loader reads), at rank 2, and its kohya file reads
    back as the diffusers one."""
    base = micro_base(family)
    tuned = load_components(ModelConfig(base=str(base)))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for model in tuned.parts().values():
            for module in model.modules():
                if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                    module.weight += 1e-2 * torch.randn(module.weight.shape, generator=generator)
    tensors, configs, rows = extract_lora(load_components(ModelConfig(base=str(base))), tuned, rank=2)
    components = load_components(ModelConfig(base=str(base)))
    names = module_names_of(components).names
    expected = {
        f"{part}.{module}"
        for part in (components.family.denoiser_name, *components.family.targets.adapted_text_encoders())
        if part in names
        for targets in [components.family.targets.targets_of(part, components.parts()[part])]
        for module in names[part]
        if any(module == target or module.endswith(f".{target}") for target in targets)
    }
    assert {row.module for row in rows} == expected
    assert all(row.rank_after == min(2, row.rank_before) for row in rows)  # a layer of one output has rank 1
    written = {
        layout: export.write_adapter(
            tmp_path / f"{layout}.safetensors", tensors, configs, "", layout, components.family, str(base)
        )
        for layout in ("diffusers", "kohya")
    }
    # A kohya file's CLIP modules read back named as A1111 and ComfyUI name them (`text_model.` always; transformers 5
    # leaves it out of CLIPTextModel's names, keeps it in CLIPTextModelWithProjection's), which peft finds either way.
    kohya, diffusers = (
        {key.replace(".text_model.", "."): change for key, change in _changes(written[layout], base).items()}
        for layout in ("kohya", "diffusers")
    )
    assert kohya.keys() == diffusers.keys()
    for module, change in kohya.items():
        torch.testing.assert_close(change, diffusers[module], rtol=1e-5, atol=1e-7)
    # ComfyUI reads the kohya file as the diffusers one merged into the base (where it holds the family's weights).
    export.merge_into_folder(str(base), [(written["diffusers"], 1.0)], tmp_path / "merged")
    merged = load_components(ModelConfig(base=str(tmp_path / "merged")))
    comfyui_applies_as(load_file(written["kohya"]), load_components(ModelConfig(base=str(base))), merged)


def _tampered(tiny_base, tmp_path, case: str):
    """A LoRA file as other tools have written broken ones (`case`), in the kohya layout where a base is needed to
    read it and in diffusers' where the base's own layers must be checked."""
    path = _lora(tiny_base, tmp_path / "made.safetensors", layout="diffusers")
    tensors = load_file(path)
    key = f"unet.{MODULES['unet'][0]}"
    if case == "mismatched":  # the up's columns are not the down's rows
        tensors[f"{key}.lora_B.weight"] = tensors[f"{key}.lora_B.weight"][:, : RANK // 2]
    elif case == "rank 0":
        tensors[f"{key}.lora_A.weight"] = tensors[f"{key}.lora_A.weight"][:0]
        tensors[f"{key}.lora_B.weight"] = tensors[f"{key}.lora_B.weight"][:, :0]
    elif case == "another base":  # a layer of the same name, of another width: another model's LoRA
        down = tensors[f"{key}.lora_A.weight"]
        tensors[f"{key}.lora_A.weight"] = torch.cat([down, down[:, :8]], dim=1)
    tampered = tmp_path / f"{case.replace(' ', '_')}.safetensors"
    with safe_open(path, framework="pt") as handle:
        save_file({key: value.contiguous() for key, value in tensors.items()}, tampered, metadata=handle.metadata())
    return tampered


TOOL_CASES = [
    ("mismatched", "its factors make no LoRA"),
    ("rank 0", "rank 0"),
    ("another base", ""),  # the widths, computed in the test
]


@pytest.mark.parametrize(("case", "said"), TOOL_CASES)
def test_the_adapter_tools_refuse_a_file_no_tool_could_apply_in_one_line(tiny_base, tmp_path, capsys, case, said):
    """resize, merge, convert and average on another tool's broken file: one line naming the file and the layer,
    nothing written (they ended in tracebacks: `mat1 and mat2 shapes cannot be multiplied`, a ZeroDivisionError,
    peft's size mismatch; `convert` wrote the mismatched file without a word)."""
    source = _tampered(tiny_base, tmp_path, case)
    if case == "another base":
        width = load_file(source)[f"unet.{MODULES['unet'][0]}.lora_A.weight"].shape[1]
        said = f"unet.{MODULES['unet'][0]} takes {width} input features in the file and {width - 8} in the base"
    base = ["--base", str(tiny_base)]
    commands = {
        "merge": ["merge", *base, "--adapter", str(source), "--out", str(tmp_path / "merged")],
        "resize": ["resize", str(source), str(tmp_path / "resized.safetensors"), "--rank", "2"],
        "convert": ["convert", str(source), str(tmp_path / "converted.safetensors"), "--to", "kohya"],
        "average": ["average", str(source), str(source), "--out", str(tmp_path / "averaged.safetensors")],
    }
    if case == "another base":  # the layers are checked against the base where a base is loaded
        commands = {name: command for name, command in commands.items() if name == "merge"}
    for name, command in commands.items():
        assert main(command) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("difftune: error: adapter ") and said in err and err.count("\n") == 1, (name, err)
        assert "Traceback" not in err
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(["made.safetensors", source.name])


def test_the_adapter_tools_refuse_a_folder_as_the_file_to_write(tiny_base, tmp_path, capsys):
    source = _lora(tiny_base, tmp_path / "lora.safetensors", layout="diffusers")
    folder = tmp_path / "out"
    folder.mkdir()
    for command in (
        ["convert", str(source), str(folder), "--to", "kohya", "--base", str(tiny_base)],
        ["resize", str(source), str(folder), "--rank", "2"],
        ["average", str(source), str(source), "--out", str(folder)],
    ):
        assert main(command) == 2
        assert f"{folder}: is a folder; name the adapter file to write" in capsys.readouterr().err
    assert list(folder.iterdir()) == []
