"""ERNIE-Image against its own pipeline beyond the conformance suite: the latents its pipeline decodes (its own
batch-norm epsilon), the transformer's prediction on the pipeline's padded text, an empty caption read as the pipeline
reads it, and the prompt enhancer never loaded."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusers import ErnieImagePipeline

from difftune.config import ModelConfig
from difftune.families import FAMILIES, load_components
from difftune.families.ernie_image import TRAINED_BATCH_NORM_EPS
from difftune.toy.tiny import build_mistral3_text_encoder, build_mistral_tokenizer

FAMILY = FAMILIES["ernie_image"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("ernie_image"))


def test_latents_are_normalised_as_the_pipeline_decodes_them_not_as_the_autoencoder_config_says(base):
    """The pipeline un-normalises with eps 1e-5 whatever `batch_norm_eps` says (1e-4 here, FLUX.2's default): difftune's
    normalisation is the exact inverse of the pipeline's; the config's would differ."""
    components = load_components(ModelConfig(base=base))
    vae = components.vae
    assert vae.config.batch_norm_eps != TRAINED_BATCH_NORM_EPS
    vae.bn.running_var.fill_(2e-4)  # a channel's variance near eps, where the two epsilons part
    latents = torch.randn(1, vae.bn.num_features, 4, 4, generator=torch.Generator().manual_seed(0))
    pipeline_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-5)  # ErnieImagePipeline.__call__'s
    decoded_by_pipeline = latents * pipeline_std + vae.bn.running_mean.view(1, -1, 1, 1)
    normalisation = FAMILY.conditioning.latent_normalization(vae)
    torch.testing.assert_close(normalisation.invert(latents), decoded_by_pipeline, rtol=1e-5, atol=0)
    from difftune.models.autoencoders import latent_normalization

    assert not torch.allclose(latent_normalization(vae).invert(latents), decoded_by_pipeline, rtol=1e-3, atol=0)


def test_denoise_is_the_pipelines_prediction_on_its_padded_text(base):
    """Two captions of different lengths, padded as the pipeline pads a batch (`_pad_text`, the lengths masking the
    rest): the transformer's prediction equals difftune's at the same latents and time."""
    components = load_components(ModelConfig(base=base))
    pipeline = components.pipeline()
    captions = ["a red circle", "a blue square with a much longer caption than the first"]
    noisy = torch.randn(
        2, FAMILY.latent_channels(components.denoiser), 4, 4, generator=torch.Generator().manual_seed(1)
    )
    timesteps = torch.tensor([250.0, 800.0])
    with torch.no_grad():
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, captions)
        )
        ours = FAMILY.denoise(components, noisy, timesteps, conditioning, None)
        states = pipeline.encode_prompt(captions, "cpu")
        text, lengths = ErnieImagePipeline._pad_text(
            states, "cpu", torch.float32, components.denoiser.config.text_in_dim
        )
        theirs = components.denoiser(hidden_states=noisy, timestep=timesteps, text_bth=text, text_lens=lengths)[0]
    assert lengths.tolist() == conditioning["text_mask"].sum(dim=1).tolist()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_an_empty_caption_is_read_as_the_pipeline_reads_it(base):
    """Caption dropout's empty caption: the tokenizer's `<s>` alone, as the pipeline falls back to, bit for bit."""
    components = load_components(ModelConfig(base=base))
    with torch.no_grad():
        ids = FAMILY.conditioning.tokenize(components.tokenizers, [""])
        ours = FAMILY.conditioning.encode_prompts(components, ids)
        [theirs] = components.pipeline().encode_prompt([""], "cpu")
    assert ids["text_encoder"][0, 0] == components.tokenizers["tokenizer"].bos_token_id
    assert int(ours["text_mask"].sum()) == len(theirs) == 1
    assert torch.equal(ours["encoder_hidden_states"][0, :1], theirs)


def test_the_prompt_enhancer_is_never_loaded_and_samples_are_drawn_without_it(base, tmp_path):
    """A base folder with its prompt enhancer (`pe`, `pe_tokenizer`), the enhancer's weights unreadable: loading for
    training and assembling the drawing pipeline never read them, and drawing asks for `use_pe=False`."""
    folder = tmp_path / "with_pe"
    shutil.copytree(base, folder)
    tokenizer = build_mistral_tokenizer(bos=True)
    build_mistral3_text_encoder(tokenizer, layers=1).save_pretrained(folder / "pe")
    tokenizer.save_pretrained(folder / "pe_tokenizer")
    for weights in (folder / "pe").glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")  # any read of it fails
    index = json.loads((folder / "model_index.json").read_text())
    index |= {"pe": ["transformers", "Mistral3ForConditionalGeneration"], "pe_tokenizer": index["tokenizer"]}
    (folder / "model_index.json").write_text(json.dumps(index))
    components = load_components(ModelConfig(base=str(folder)))
    pipeline = components.pipeline()
    assert pipeline.pe is None and pipeline.pe_tokenizer is None
    assert FAMILY.drawing.sampling_arguments(components, 4.0, "")["use_pe"] is False


# ComfyUI's ERNIE-Image model (`comfy/ldm/ernie/model.py`, `ErnieImageModel`): its weights' names, a block's given for
# block 0. ComfyUI loads a diffusion-model file by these names and reaches a LoRA's `lora_unet_<name with _>` keys by
# them, so the single file and the kohya layout must use them.
COMFYUI_NAMES = {
    "x_embedder.proj.weight",
    "x_embedder.proj.bias",
    "text_proj.weight",
    "time_embedding.linear_1.weight",
    "time_embedding.linear_1.bias",
    "time_embedding.linear_2.weight",
    "time_embedding.linear_2.bias",
    "adaLN_modulation.1.weight",
    "adaLN_modulation.1.bias",
    "final_norm.linear.weight",
    "final_norm.linear.bias",
    "final_linear.weight",
    "final_linear.bias",
    *(
        f"layers.0.{name}.weight"
        for name in (
            "adaLN_sa_ln",
            "self_attention.to_q",
            "self_attention.to_k",
            "self_attention.to_v",
            "self_attention.norm_q",
            "self_attention.norm_k",
            "self_attention.to_out.0",
            "adaLN_mlp_ln",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.linear_fc2",
        )
    ),
}


def test_the_single_file_names_its_weights_as_comfyui_does(base):
    components = load_components(ModelConfig(base=base))
    assert set(FAMILY.layout.to_single_file(components)) == COMFYUI_NAMES
    assert FAMILY.layout.reads_single_file(COMFYUI_NAMES)
    assert all(
        FAMILIES[name].layout.reads_single_file(COMFYUI_NAMES) is False for name in FAMILIES if name != FAMILY.name
    )


def test_ai_toolkits_files_are_read_by_diffusers_and_by_difftune_as_the_same_change(make_config, base, tmp_path):
    """ai-toolkit writes ERNIE-Image LoRAs as `diffusion_model.<module>.lora_A.weight` (the names ComfyUI's model and
    diffusers' both use). Such a file made from a difftune run, read by `ErnieImagePipeline.load_lora_weights`
    (diffusers' own reader of those files), draws what difftune's diffusers-layout file draws; and difftune reads it
    (`difftune sample` / `merge` / `convert`) as the same change."""
    from safetensors.torch import load_file, save_file

    from difftune.adapters import export
    from difftune.training.train import train

    trained = train(
        make_config(
            model__base=base,
            train__output_dir=str(tmp_path / "run"),
            train__max_steps=2,
            optim__learning_rate=2e-2,
            sample__prompts=[],
        )
    ).trained_path
    ai_toolkit = {
        key.replace("transformer.", "diffusion_model.", 1): value for key, value in load_file(trained).items()
    }
    save_file(ai_toolkit, tmp_path / "ai_toolkit.safetensors")
    arguments = {
        "height": 32,
        "width": 32,
        "num_inference_steps": 4,
        "guidance_scale": 3.0,
        "use_pe": False,
        "output_type": "latent",
    }

    def drawn(pipeline) -> torch.Tensor:
        pipeline.set_progress_bar_config(disable=True)
        return pipeline("a purple circle", generator=torch.Generator().manual_seed(0), **arguments).images

    by_diffusers = {}
    for name, adapter in (("ours", str(trained)), ("ai_toolkit", str(tmp_path / "ai_toolkit.safetensors"))):
        pipeline = ErnieImagePipeline.from_pretrained(base, dtype=torch.float32)
        pipeline.load_lora_weights(adapter)
        by_diffusers[name] = drawn(pipeline)
    base_drawing = drawn(ErnieImagePipeline.from_pretrained(base, dtype=torch.float32))
    assert (by_diffusers["ours"] - base_drawing).abs().max() > 1e-3  # the adapter changes the drawing
    torch.testing.assert_close(by_diffusers["ai_toolkit"], by_diffusers["ours"], rtol=0, atol=1e-5)
    read_by_difftune = export.load_with_adapters(base, [(tmp_path / "ai_toolkit.safetensors", 1.0)]).pipeline()
    torch.testing.assert_close(drawn(read_by_difftune), by_diffusers["ours"], rtol=0, atol=1e-5)
