"""Flux through the family interface: packing, conditioning, the flow-matching objective, training, export, interop."""

import math

import numpy as np
import pytest
import torch
from diffusers import ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.loaders.single_file_utils import (
    convert_chroma_transformer_checkpoint_to_diffusers,
    convert_flux_transformer_checkpoint_to_diffusers,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from difftune.adapters import export
from difftune.config import LossConfig, ModelConfig, load_config
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, family_of, load_components
from difftune.families.common.flow import resolution_shift, shifted
from difftune.families.common.tokens import pack, unpack
from difftune.families.flux import image_position_ids
from difftune.training.train import train

FLUX = FAMILIES["flux"]


def test_detection_packing_and_position_ids_are_the_pipelines(tiny_flux_base):
    assert family_of(ModelConfig(base=str(tiny_flux_base))) is FLUX
    latents = torch.randn(2, 16, 8, 6)
    packed = pack(latents)
    torch.testing.assert_close(packed, FluxPipeline._pack_latents(latents, 2, 16, 8, 6), rtol=0, atol=0)
    assert torch.equal(unpack(packed, 8, 6), latents)
    expected = FluxPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32)
    assert torch.equal(image_position_ids(8, 6, "cpu", torch.float32), expected)


def test_prompt_conditioning_is_what_the_flux_pipeline_makes(tiny_flux_base):
    components = load_components(ModelConfig(base=str(tiny_flux_base)))
    pipeline = components.pipeline()
    prompts = ["a red circle", "a blue square"]
    with torch.no_grad():
        states, pooled, _ = pipeline.encode_prompt(prompts, prompts, device="cpu", max_sequence_length=32)
        ours = FLUX.conditioning.encode_prompts(components, FLUX.conditioning.tokenize(components.tokenizers, prompts))
    torch.testing.assert_close(ours["encoder_hidden_states"], states, rtol=0, atol=0)
    torch.testing.assert_close(ours["pooled_prompt_embeds"], pooled, rtol=0, atol=0)
    # T5 appends </s> and pads with <pad>; a space is part of the next piece (`▁r`): one piece per other character.
    assert ours["text_mask"].sum(dim=1).tolist() == [len(prompt.replace(" ", "")) + 1 for prompt in prompts]


def test_the_objective_is_rectified_flow_with_sd3_weightings(tiny_flux_base, monkeypatch):
    """x_t = (1 - s) x0 + s noise; the target is noise - x0: a denoiser that returns exactly that scores 0, one that
    returns zeros scores the target's mean square, weighted per sample by sigma^-2 under `sigma_sqrt`."""
    components = load_components(ModelConfig(base=str(tiny_flux_base)))
    latents, noise = torch.randn(3, 16, 8, 8), torch.randn(3, 16, 8, 8)
    timesteps = torch.tensor([100.0, 500.0, 900.0])
    seen = {}

    def oracle(self, components, noisy, t, conditioning, geometry):
        sigma = (t / 1000).view(-1, 1, 1, 1)
        seen["noisy"] = noisy
        return noise - latents if seen.get("exact") else torch.zeros_like(noisy) + 0 * sigma

    monkeypatch.setattr(type(FLUX), "denoise", oracle)
    seen["exact"] = True
    exact = FLUX.objective.loss(components, latents, timesteps, noise, {}, None, LossConfig())
    sigma = (timesteps / 1000).view(-1, 1, 1, 1)
    torch.testing.assert_close(seen["noisy"], (1 - sigma) * latents + sigma * noise)
    assert exact.abs().max() == 0
    seen["exact"] = False
    plain = FLUX.objective.loss(components, latents, timesteps, noise, {}, None, LossConfig())
    torch.testing.assert_close(plain, (noise - latents).square().mean(dim=(1, 2, 3)))
    weighted = FLUX.objective.loss(components, latents, timesteps, noise, {}, None, LossConfig(weighting="sigma_sqrt"))
    torch.testing.assert_close(weighted, plain / (timesteps / 1000) ** 2)


def test_noise_levels_are_drawn_per_sample_and_shifted_as_the_scheduler_shifts(tiny_flux_base):
    components = load_components(ModelConfig(base=str(tiny_flux_base)))
    latents = torch.zeros(2, 16, 8, 8)

    def draw(seeds, **loss):
        return (
            FLUX.objective.draw_timesteps_and_noise(
                components, [torch.Generator().manual_seed(s) for s in seeds], latents, LossConfig(**loss)
            )[0]
            / 1000
        )

    plain = draw((1, 2))
    assert torch.equal(draw((2,)), plain[1:])  # a sample's draw is its own
    torch.testing.assert_close(draw((1, 2), flow_shift=3.0), 3 * plain / (1 + 2 * plain))
    # The resolution shift is what FlowMatchEulerDiscreteScheduler applies at this size (16 tokens).
    mu = math.log(resolution_shift(components.noise_scheduler.config, 16))
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(components.noise_scheduler.config)
    scheduler.set_timesteps(sigmas=plain.tolist(), mu=mu)
    torch.testing.assert_close(draw((1, 2), flow_shift_by_resolution=True), scheduler.sigmas[:2], rtol=1e-5, atol=1e-6)
    assert torch.allclose(shifted(plain, 1.0), plain)
    logit = draw(range(400), timestep_sampling="logit_normal")
    assert 0.45 < logit.median() < 0.55 and ((logit > 0.2) & (logit < 0.8)).float().mean() > 0.75


def test_guidance_embedding_and_padding_mask_condition_the_transformer(micro_base):
    """A guidance-distilled base conditions on `model.family_options.guidance`; with its `text_padding_mask` the T5
    padding's states no longer reach the image tokens, without it they do."""
    guided = micro_base("flux", seed=2, guidance=True)
    noisy, timesteps = torch.randn(1, 16, 8, 8), torch.tensor([600.0])

    def predict(padding_states, **options):
        components = load_components(ModelConfig(base=str(guided), family_options=options))
        with torch.no_grad():
            conditioning = FLUX.conditioning.encode_prompts(
                components, FLUX.conditioning.tokenize(components.tokenizers, ["a red circle"])
            )
            pad = ~conditioning["text_mask"][0]
            conditioning["encoder_hidden_states"][0, pad] = padding_states
            return FLUX.denoise(components, noisy, timesteps, conditioning, None)

    assert not torch.allclose(predict(0.0), predict(0.0, guidance=4.0))
    assert not torch.allclose(predict(0.0), predict(5.0))
    torch.testing.assert_close(predict(0.0, text_padding_mask=True), predict(5.0, text_padding_mask=True))


def _trained(make_config, base, tmp_path, kind, **overrides):
    settings = {"adapter__text_encoder": True, "train__max_steps": 4, "optim__learning_rate": 2e-2}
    config = make_config(
        model__base=str(base), adapter__kind=kind, train__output_dir=str(tmp_path / kind), **settings | overrides
    )
    return train(config)


def _render(pipeline, prompt="a purple circle") -> np.ndarray:
    pipeline.set_progress_bar_config(disable=True)
    return pipeline(
        prompt,
        negative_prompt="",
        true_cfg_scale=3.0,
        num_inference_steps=4,
        height=32,
        width=32,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images[0]


def test_kohya_layout_fuses_as_the_original_model_and_round_trips_exactly(make_config, tiny_flux_base, tmp_path):
    result = _trained(make_config, tiny_flux_base, tmp_path, "dora")
    kohya = export.convert_adapter(result.trained_path, tmp_path / "kohya.safetensors", "kohya")
    back = export.convert_adapter(kohya, tmp_path / "back.safetensors", "diffusers")
    written = load_file(kohya)
    names = {key.split(".")[0] for key in written}
    # ComfyUI's names for the original model's modules: fused qkv per stream, a single block's linear1.
    assert {
        "lora_unet_double_blocks_0_img_attn_qkv",
        "lora_unet_double_blocks_0_txt_attn_qkv",
        "lora_unet_double_blocks_0_img_mlp_2",
        "lora_unet_single_blocks_0_linear1",
        "lora_te1_text_model_encoder_layers_0_self_attn_q_proj",
    } <= names
    assert all(
        key.startswith(("lora_unet_double_blocks_", "lora_unet_single_blocks_", "lora_te1_text_model_"))
        for key in written
    )
    qkv = "lora_unet_double_blocks_0_img_attn_qkv"
    r = load_config(result.trained_path.parent / "config.toml").adapter.rank
    assert written[f"{qkv}.lora_down.weight"].shape == (3 * r, 32)  # three rank-r adapters, stacked
    assert written[f"{qkv}.lora_up.weight"].shape == (3 * 32, 3 * r) and written[f"{qkv}.dora_scale"].shape == (96, 1)
    single = written["lora_unet_single_blocks_0_linear1.lora_up.weight"]
    assert single.shape == (3 * 32 + 4 * 32, 4 * r)  # q, k, v and the 4x wider MLP input
    with safe_open(kohya, framework="pt") as handle:
        assert handle.metadata()["ss_base_model_version"] == "flux1"
    original, again = load_file(result.trained_path), load_file(back)
    assert original.keys() == again.keys()
    assert all(torch.equal(original[key], again[key]) for key in original)


def test_diffusers_reads_our_fused_kohya_qkv(make_config, tiny_flux_base, tmp_path):
    """diffusers' own kohya-Flux reader (what ai-toolkit-style files go through) splits our fused qkv back and
    renders the merged model's image. Its reader assumes FLUX.1's widths for a single block's linear1, so the
    adapter here sits in the double block only."""
    targets = [
        f"transformer_blocks.0.{m}"
        for m in (
            "attn.to_q",
            "attn.to_k",
            "attn.to_v",
            "attn.to_out.0",
            "attn.add_q_proj",
            "attn.add_k_proj",
            "attn.add_v_proj",
            "ff.net.2",
        )
    ]
    result = _trained(
        make_config,
        tiny_flux_base,
        tmp_path,
        "lora",
        adapter__text_encoder=False,
        adapter__target_modules=targets,
        export__format="kohya",
    )
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in load_file(result.trained_path)
    theirs = FluxPipeline.from_pretrained(tiny_flux_base, dtype=torch.float32)
    theirs.load_lora_weights(str(result.trained_path.parent), weight_name=result.trained_path.name)
    assert sum("lora_A" in key for key in theirs.transformer.state_dict()) == len(targets)
    [merged_dir] = export.merge_into_folder(str(tiny_flux_base), [(result.trained_path, 1.0)], tmp_path / "merged")
    assert np.abs(_render(theirs) - _render(FluxPipeline.from_pretrained(merged_dir, dtype=torch.float32))).max() < 2e-3


def test_a_kohya_trained_fused_adapter_is_read_as_the_same_change(tiny_flux_base, tmp_path):
    """kohya trains the fused qkv as one LoRA (one shared down, a dense up): read back, each of q, k, v gets that
    down and its rows of the up, and the adapted projections change by exactly scale x up @ down."""
    from difftune.adapters.export import apply_adapters

    down, up = torch.randn(4, 32) * 0.1, torch.randn(96, 4) * 0.1
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    save_file(
        {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up, f"{name}.alpha": torch.tensor(2.0)},
        tmp_path / "kohya.safetensors",
        metadata={"ss_base_model_version": "flux1"},
    )
    components = load_components(ModelConfig(base=str(tiny_flux_base)))
    attention = components.denoiser.transformer_blocks[0].attn
    before = {p: getattr(attention, p).weight.detach().clone() for p in ("to_q", "to_k", "to_v")}
    apply_adapters(components, [(tmp_path / "kohya.safetensors", 1.0)])
    x = torch.randn(3, 32)
    change = (up @ down) * (2.0 / 4)
    for i, projection in enumerate(("to_q", "to_k", "to_v")):
        expected = (
            x @ (before[projection] + change[32 * i : 32 * (i + 1)]).T + getattr(attention, projection).base_layer.bias
        )
        torch.testing.assert_close(getattr(attention, projection)(x), expected, rtol=1e-5, atol=1e-5)


def test_kohya_layout_refuses_a_partly_adapted_fused_layer(make_config, tiny_flux_base, tmp_path):
    """Refused before training, not after it: a run must not end unable to save."""
    with pytest.raises(
        DifftuneError,
        match=r"export.format = \"kohya\": the kohya Flux layout fuses "
        r"single_transformer_blocks.0.attn.to_q, .*proj_mlp into single_blocks_0_linear1: adapt all of them",
    ):
        _trained(
            make_config,
            tiny_flux_base,
            tmp_path,
            "lora",
            adapter__text_encoder=False,
            adapter__target_modules=["attn.to_q"],
            export__format="kohya",
        )


def test_settings_a_family_cannot_train_with_are_refused(make_config, tiny_flux_base, tiny_base):
    with pytest.raises(DifftuneError, match=r"flow-matching.*loss.weighting = \"min_snr\": is for the UNet families"):
        train(make_config(model__base=str(tiny_flux_base), loss__weighting="min_snr"))
    with pytest.raises(DifftuneError, match=r"loss.prediction_type = \"epsilon\""):
        train(make_config(model__base=str(tiny_flux_base), loss__prediction_type="epsilon"))
    with pytest.raises(DifftuneError, match=r"loss.flow_shift: for flow-matching families"):
        train(make_config(model__base=str(tiny_base), loss__flow_shift=3.0))
    with pytest.raises(DifftuneError, match=r"sample.scheduler = \"ddim\": not a sampler for Flux"):
        train(make_config(model__base=str(tiny_flux_base), sample__scheduler="ddim", sample__prompts=["a red circle"]))
    t5_adapter = tiny_flux_base.parent / "t5.safetensors"
    save_file(
        {
            "text_encoder_2.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": torch.zeros(2, 64),
            "text_encoder_2.encoder.block.0.layer.0.SelfAttention.q.lora_B.weight": torch.zeros(64, 2),
        },
        t5_adapter,
    )
    with pytest.raises(DifftuneError, match=r"has weights for text_encoder_2, which Flux.* do not load"):
        export.apply_adapters(load_components(ModelConfig(base=str(tiny_flux_base))), [(t5_adapter, 1.0)])


def test_cached_latents_and_text_train_exactly_as_encoding_each_step(make_config, tiny_flux_base, tmp_path):
    settings = {
        "model__base": str(tiny_flux_base),
        "train__max_steps": 3,
        "model__family_options__text_padding_mask": True,
        "loss__timestep_sampling": "logit_normal",
        "loss__flow_shift_by_resolution": True,
    }
    plain = train(make_config(train__output_dir=str(tmp_path / "plain"), **settings))
    cached = train(
        make_config(
            train__output_dir=str(tmp_path / "cached"),
            cache__latents=True,
            cache__text=True,
            cache__dir=str(tmp_path / "cache"),
            **settings,
        )
    )
    assert cached.components.text_encoders == {"text_encoder": None, "text_encoder_2": None}  # released
    entry = next((tmp_path / "cache" / "text").rglob("*.safetensors"))
    assert set(load_file(entry)) == {"encoder_hidden_states", "pooled_prompt_embeds", "text_mask"}
    assert cached.losses == pytest.approx(plain.losses, rel=1e-5)
    resolved = load_config(tmp_path / "cached" / "config.toml")
    assert resolved.model.family == "flux" and resolved.model.family_options == {"text_padding_mask": True}


@pytest.mark.parametrize("name", ["flux", "chroma"])
def test_single_files_are_bfls_layout_as_diffusers_converters_read_it(name):
    """diffusers' FLUX.1 and Chroma converters (what `from_single_file` reads BFL's and lodestones' files with) assume
    FLUX.1's widths, 3072 and a 4x MLP: one block of each kind at those widths, built on the meta device, its
    weights random bytes read as fp8 (every value compared bit for bit, half a GB a copy)."""
    model_class, convert, settings = {
        "flux": (FluxTransformer2DModel, convert_flux_transformer_checkpoint_to_diffusers, {"guidance_embeds": True}),
        "chroma": (
            ChromaTransformer2DModel,
            convert_chroma_transformer_checkpoint_to_diffusers,
            {"approximator_hidden_dim": 64, "approximator_layers": 2},
        ),
    }[name]
    with torch.device("meta"):
        model = model_class(num_layers=1, num_single_layers=1, joint_attention_dim=64, **settings)
    ours = {
        key: torch.randint(0, 256, value.shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
        for key, value in model.state_dict().items()
    }
    original = FAMILIES[name].layout.original_state_dict(ours)
    assert {
        "double_blocks.0.img_attn.qkv.weight",
        "single_blocks.0.linear1.weight",
        "final_layer.linear.weight",
    } <= set(original)
    theirs = convert({f"model.diffusion_model.{key}": value for key, value in original.items()})  # ComfyUI's prefix
    back = FAMILIES[name].layout.diffusers_state_dict(original)
    assert theirs.keys() == ours.keys() == back.keys()
    for key, value in ours.items():
        assert torch.equal(theirs[key].view(torch.uint8), value.view(torch.uint8)), key
        assert torch.equal(back[key].view(torch.uint8), value.view(torch.uint8)), key
