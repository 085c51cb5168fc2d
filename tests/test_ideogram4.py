"""Ideogram 4 against its own pipeline beyond the conformance suite: the transformer's prediction on the pipeline's
packed layout, the latents the pipeline decodes, its schedule's resolution rule, the unconditional transformer kept
out of training, and the kohya layout as diffusers' reader of ai-toolkit's files reads it."""

from __future__ import annotations

import pytest
import torch
from diffusers import Ideogram4Pipeline
from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _resolution_aware_mu
from safetensors.torch import load_file, save_file

from difftune.adapters import export
from difftune.config import ModelConfig
from difftune.families import FAMILIES, load_components
from difftune.families.ideogram4 import ORIGINAL_BLOCKS, token_order
from difftune.models.autoencoders import encode_posterior
from difftune.models.components import encoder_placement, host_kept_encoders
from difftune.training.train import train

FAMILY = FAMILIES["ideogram4"]
PROMPTS = ["a red circle", "a blue square with a longer caption"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("ideogram4", seed=2))


def test_denoise_is_the_pipelines_conditional_prediction_turned_round(base):
    """On the pipeline's own layout (every caption left-padded to `max_sequence_length`, its `encode_prompt`), the
    transformer's velocity at the image tokens is minus difftune's prediction at the same latents and time."""
    components = load_components(ModelConfig(base=base))
    pipeline = components.pipeline()
    h = w = 4
    noisy = torch.randn(
        2, FAMILY.latent_channels(components.denoiser), h, w, generator=torch.Generator().manual_seed(0)
    )
    timesteps = torch.tensor([250.0, 800.0])
    with torch.no_grad():
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, PROMPTS)
        )
        ours = FAMILY.denoise(components, noisy, timesteps, conditioning, None)
        features, position_ids, segment_ids, indicator = pipeline.encode_prompt(PROMPTS, h, w, 64, "cpu")
        tokens = token_order(noisy)
        theirs = pipeline.transformer(
            hidden_states=torch.cat([torch.zeros(2, 64, tokens.shape[-1]), tokens], dim=1),
            timestep=1 - timesteps / 1000,
            encoder_hidden_states=features,
            position_ids=position_ids,
            segment_ids=segment_ids,
            indicator=indicator,
            return_dict=False,
        )[0][:, 64:]
    torch.testing.assert_close(token_order(-ours), theirs, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(token_order(ours), theirs, atol=1e-3)  # the sign matters


def test_latents_are_what_the_pipeline_decodes(base):
    """An image's normalised latents, in token order, are what `Ideogram4Pipeline` denormalises and unpacks for its
    autoencoder: decoding them its way gives back the autoencoder's own latents, channel for channel."""
    components = load_components(ModelConfig(base=base))
    vae = components.vae
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        mean = encode_posterior(vae, pixels)[0]
        tokens = token_order(components.latent_normalization.apply(mean))
        # Ideogram4Pipeline.__call__'s decoding, step for step.
        std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps)
        z = tokens * std.view(1, 1, -1) + vae.bn.running_mean.view(1, 1, -1)
        z = z.view(1, 4, 4, 2, 2, -1).permute(0, 5, 1, 3, 2, 4).reshape(1, -1, 8, 8)
        raw = vae.encode(pixels).latent_dist.mean
    torch.testing.assert_close(z, raw, rtol=1e-4, atol=1e-5)
    # The statistics are not symmetric in the two orders: read FLUX.2's way, the latents would differ.
    assert not torch.allclose(
        components.latent_normalization.apply(mean),
        FAMILIES["flux2"].conditioning.latent_normalization(vae).apply(mean),
    )


def test_noise_levels_follow_the_pipelines_schedule_mean():
    """The resolution shift is exp(mu) of the pipeline's schedule at that size (base mean 0)."""
    for side in (512, 1024, 1536):
        tokens = (side // 16) ** 2
        mu = _resolution_aware_mu(side, side, base_mu=0.0)
        assert abs(FAMILY.objective.resolution_shift(None, tokens) - torch.tensor(mu).exp().item()) < 1e-9


def test_the_unconditional_transformer_waits_in_host_memory_only_for_previews(make_config, base, tmp_path):
    """Training never runs it: kept in host memory when previews draw, released (and reloaded to draw at the end)
    otherwise; a negative prompt, which it could not read, is refused."""
    components = load_components(ModelConfig(base=base))
    previews = make_config(
        model__base=base, train__output_dir=str(tmp_path), sample__every_steps=2, sample__prompts=["a purple circle"]
    )
    assert encoder_placement(previews)["drawing"] == "host"
    assert any(
        m is components.drawing_parts["unconditional_transformer"] for m in host_kept_encoders(components, previews)
    )
    assert encoder_placement(make_config(model__base=base, train__output_dir=str(tmp_path)))["drawing"] == "released"
    problems = FAMILY.config_problems(
        make_config(model__base=base, train__output_dir=str(tmp_path), sample__negative_prompt="blurry")
    )
    assert any("unconditional transformer" in problem for problem in problems)


def test_the_kohya_layout_is_ai_toolkits_as_diffusers_reads_it(make_config, base, tmp_path):
    """The kohya layout names the original modules (q, k and v fused): the same file under ai-toolkit's prefix and
    dots (`diffusion_model.layers.0.attention.qkv`), read by `Ideogram4Pipeline.load_lora_weights` (diffusers' own
    reader of those files), draws what difftune's diffusers-layout file draws; and difftune reads that ai-toolkit
    file too (`difftune sample` / `merge` / `convert`), as the same change."""
    trained = train(
        make_config(
            model__base=base,
            train__output_dir=str(tmp_path / "run"),
            train__max_steps=2,
            optim__learning_rate=2e-2,
            sample__prompts=[],
        )
    ).trained_path
    kohya = load_file(export.convert_adapter(trained, tmp_path / "kohya.safetensors", "kohya"))
    dotted = {name.replace(".", "_"): name for name in ORIGINAL_BLOCKS["layers"][1]}
    ai_toolkit = {}
    for key, value in kohya.items():
        module, _, kind = key.removeprefix("lora_unet_layers_").partition(".")
        index, _, layer = module.partition("_")
        ai_toolkit[f"diffusion_model.layers.{index}.{dotted[layer]}.{kind}"] = value

    def drawn(adapter) -> torch.Tensor:
        pipeline = Ideogram4Pipeline.from_pretrained(base, dtype=torch.float32)
        pipeline.set_progress_bar_config(disable=True)
        if adapter is not None:
            pipeline.load_lora_weights(adapter)
        return pipeline(
            "a purple circle",
            height=32,
            width=32,
            num_inference_steps=4,
            guidance_scale=3.0,
            guidance_schedule=None,
            max_sequence_length=64,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        ).images

    ours = drawn(str(trained))
    torch.testing.assert_close(drawn(ai_toolkit), ours, rtol=0, atol=1e-4)
    save_file(ai_toolkit, tmp_path / "ai_toolkit.safetensors")
    read_by_difftune = export.load_with_adapters(base, [(tmp_path / "ai_toolkit.safetensors", 1.0)]).pipeline()
    read_by_difftune.set_progress_bar_config(disable=True)
    theirs = read_by_difftune(
        "a purple circle",
        height=32,
        width=32,
        num_inference_steps=4,
        guidance_scale=3.0,
        guidance_schedule=None,
        max_sequence_length=64,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    ).images
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    assert (ours - drawn(None)).abs().max() > 1e-2  # the adapter changes the drawing, far beyond that agreement
