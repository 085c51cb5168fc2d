"""Micro LTX-2.5: micro LTX-2's parts (ltx2/micro.py: its causal video autoencoder at 4x in space and time, its audio
autoencoder and vocoder) in LTX-2.5's configuration (the transformer's gated attention, fixed caption modulation,
feed-forward layers without biases and keyframe embedding; the connectors' projection per stream), read by a 2-layer
Gemma 4 (`Gemma4UnifiedForConditionalGeneration`, the real text encoder's class), with LTX-2.5's diffusion decoder
at 4x in space and time, in LTX-2.5's modular pipeline."""

import torch
from diffusers import LTX2VideoDiffusionDecoderModel
from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration, Gemma4UnifiedTextConfig

from difftune.families.ltx2.micro import (  # noqa: F401 (autoencoder: LTX-2's, the one this builder names)
    TEXT_LAYERS,
    autoencoder,
    build_ltx2_parts,
    build_ltx2_scheduler,
    gemma_text_sizes,
)
from difftune.toy.micro import MicroSizes
from difftune.toy.tiny import QWEN_HIDDEN_SIZE, build_llama_tokenizer


def pipeline(vae, sizes: MicroSizes):
    from difftune.families import FAMILIES

    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    # 4 heads at least: the video stream 32 wide, as the blocks of GGUF's quantizations are (LTX-2.5 projects the
    # caption per stream, so micro LTX-2's caption projection, a layer of that width, is not there).
    heads = max(sizes.dit_heads, 4)
    tokenizer = build_llama_tokenizer()
    # Widths of LTX-2.5's streams: the video's `heads` x 8, the sound's 4 `heads` (ltx2/micro.py), each connector as
    # wide as the stream it feeds.
    parts = build_ltx2_parts(
        width,
        TEXT_LAYERS,
        layers=sizes.dit_layers or 1,
        heads=heads,
        latent_channels=vae.config.latent_channels,
        connector_options={
            "per_modality_projections": True,
            "video_hidden_dim": 8 * heads,
            "audio_hidden_dim": 4 * heads,
            "video_connector_attention_head_dim": 4 * heads,
            "audio_connector_attention_head_dim": 2 * heads,
            "video_gated_attn": True,
            "audio_gated_attn": True,
        },
        transformer_options={
            "gated_attn": True,
            "audio_gated_attn": True,
            "cross_attn_mod": True,
            "audio_cross_attn_mod": True,
            "use_prompt_embeddings": False,
            "ff_bias": False,
            "use_prompt_adaln_single": False,
            "use_keyframes_abs_pos_embedding": True,
            "perturbed_attn": True,
        },
    )
    modular = FAMILIES["ltx25"].loading.modular_pipeline()
    modular.update_components(
        vae=vae,
        text_encoder=build_gemma4_text_encoder(tokenizer, width, TEXT_LAYERS),
        tokenizer=tokenizer,
        diffusion_decoder=build_diffusion_decoder(vae),
        scheduler=build_ltx2_scheduler(),
        **parts,
    )
    return modular


def build_gemma4_text_encoder(tokenizer, hidden_size: int, layers: int) -> Gemma4UnifiedForConditionalGeneration:
    """Gemma 4 of `layers` narrow layers (the last one full attention, as Gemma 4 requires)."""
    text = Gemma4UnifiedTextConfig(
        **gemma_text_sizes(tokenizer, hidden_size, layers),
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
        per_layer_config={str(layers - 1): {"head_dim": hidden_size // 2}},
    )
    return Gemma4UnifiedForConditionalGeneration(Gemma4UnifiedConfig(text_config=text))


def build_diffusion_decoder(vae) -> LTX2VideoDiffusionDecoderModel:
    """The diffusion decoder at the autoencoder's 4x in space and time (pixels patched 2 x 2 after one 2x spatial and
    two 2x temporal upsamplings; the real one: 32x and 8x), one block a stage, 3 x 3 x 3 neighbourhoods, one x0 step
    as LTX-2.5 ships it; the latents' statistics the autoencoder's (it reads the same latents)."""
    width = 16
    decoder = LTX2VideoDiffusionDecoderModel(
        latent_channels=vae.config.latent_channels,
        patch_size=2,
        decoder_head_dim=8,
        decoder_stage_channels=(width,) * 5,
        decoder_stage_depths=(1,) * 5,
        decoder_stage_kernels=((3, 3, 3),) * 4,
        decoder_upsample_strides=((1, 2, 2), (2, 1, 1), (2, 1, 1), (1, 1, 1)),
        decoder_upsample_channel_reductions=(1,) * 4,
        decoder_stage5_kernel=(3, 3, 3),
        decoder_t_emb_dim=width,
        spatial_compression_ratio=4,
        temporal_compression_ratio=4,
    )
    with torch.no_grad():
        decoder.latents_mean.copy_(vae.latents_mean)
        decoder.latents_std.copy_(vae.latents_std)
    return decoder
