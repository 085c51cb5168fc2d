"""Each family's training loss against diffusers' own training script for it, on the same micro model, images, noise,
timesteps and prompts: the check that difftune's objective (latent normalisation, noising, the denoiser's inputs,
the target, the weighting) is the reference trainers' and not just self-consistent.

The scripts are not copied here: each `*_script_loss` below writes the formula its script uses, read from
huggingface/diffusers at commit 58eb52c0 (examples/dreambooth/; sha256 of each file in `SCRIPTS`), with the lines it
follows named (scripts newer than that commit: read at the commit `LATER_SCRIPTS` or `REFERENCE_SCRIPTS` names; the
latter train a family's references, beside its text-to-image script). What the scripts draw at
random (noise, timesteps: `compute_density_for_timestep_sampling` then the scheduler's `timesteps[indices]`) is
fixed here and given to both sides; the scripts' posterior `sample()` is taken at its mode on both sides (Z-Image's
script takes the mode itself).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from diffusers import (
    DDPMScheduler,
    FlowMatchEulerDiscreteScheduler,
    Flux2Pipeline,
    FluxKontextPipeline,
    FluxPipeline,
    Krea2Pipeline,
    QwenImage21Pipeline,
    QwenImagePipeline,
    SanaPipeline,
)
from diffusers.training_utils import compute_loss_weighting_for_sd3, compute_snr

from difftune.config import LossConfig, ModelConfig
from difftune.data.dataset import image_to_tensor
from difftune.families import FAMILIES, load_components
from difftune.families.ideogram4 import patched_order, token_order
from difftune.models.autoencoders import encode_posterior, reference_latents
from difftune.toy.tiny import shape_images

# examples/dreambooth/<script> at diffusers 58eb52c0 -> sha256 of the file read.
SCRIPTS = {
    "sd": ("train_dreambooth_lora.py", "89cd066f65b2c5d4e8ab578f4050f485a880a9c8fc100ddf18c6b0c74eadb5d2"),
    "sdxl": ("train_dreambooth_lora_sdxl.py", "ab3165d44c29115028c18933bcf12bb583fd0e868c3d8dd426dec5209eb6d6d1"),
    "flux": ("train_dreambooth_lora_flux.py", "1e7862bbfb16f2d5fa6f3424a93c2d8383ba4b5f1509c6265777e1eb84d070ef"),
    "flux_kontext": (
        "train_dreambooth_lora_flux_kontext.py",
        "821f168bf4b8a38af53d128e0711e13b11c8784f618225502b5f542bdc47f1df",
    ),
    "flux2": ("train_dreambooth_lora_flux2.py", "f487a423f5873a1da99295803e7105b272c5ccdc9bd3b5961af47fec6259278b"),
    "flux2_klein": (
        "train_dreambooth_lora_flux2_klein.py",
        "2c746004af6d4aa569d9bff3d32fce70afcb885cf00c7e00ab6abf9beda42225",
    ),
    "lumina2": ("train_dreambooth_lora_lumina2.py", "0cd38a84e95d0a3331c4f12e6bd02fe7dab0bc56d31c22cc9edaa308c0ddd670"),
    "sana": ("train_dreambooth_lora_sana.py", "d938da709cfec4c79abbb7c78a8ca8a955d4c8151bd9f5a72b2685023fc24549"),
    "hidream": ("train_dreambooth_lora_hidream.py", "5415a0cf050054532b94926e132533e6e00cc94b43995b472b6885ac9e2bb649"),
    "ideogram4": (
        "train_dreambooth_lora_ideogram4.py",
        "4130139d734fbc3e0b1aeac7d06a735e2bbe0734200655f1dd178f8314ad3ba5",
    ),
    "krea2": ("train_dreambooth_lora_krea2.py", "e88d55cb8bf6f1a0d672330661752b982ab7c0a1623980e1673b8b2d303ef948"),
    "qwen_image": (
        "train_dreambooth_lora_qwen_image.py",
        "7c06f0297e5ddc909efa897736be58ca0b743fbef93a9681d35cbe9a74e29cb2",
    ),
    "sd3": ("train_dreambooth_lora_sd3.py", "74f4cfd22527673c10f4e7a7b2a2b117ef554a0190bfa5876210f7d365e393bb"),
    "z_image": ("train_dreambooth_lora_z_image.py", "7111596fe60ac7f016e662acb08ab7874bb51d1ef855d63f30eea3e5b731585a"),
}
# examples/dreambooth/<script> at a later diffusers commit (the stored snapshot at 58eb52c0 predates them).
LATER_SCRIPTS = {
    "qwen_image21": ("train_dreambooth_lora_qwenimage21.py", "01e3a5d6b66ca07d3fc21e9c541e0c3e8cad78ca"),
}
# examples/dreambooth/<script> at the commit named: the scripts that train a text-to-image family's references (its
# edit pairs), checked beside its text-to-image script.
REFERENCE_SCRIPTS = {
    "flux2": ("train_dreambooth_lora_flux2_img2img.py", "79c110752f80aafaaf67a7b4baa573f6c9d2224d"),
    "flux2_klein": ("train_dreambooth_lora_flux2_klein_img2img.py", "027e8eebf33896eecb64c74836258c52593259d5"),
}
PROMPTS = ["a red circle", "a blue square with a longer caption"]
TIMESTEP_INDICES = torch.tensor([150, 700])  # the scripts' `indices = (u * num_train_timesteps).long()`
GUIDANCE = 3.5  # the Kontext and FLUX.2 scripts' default `--guidance_scale`


def _pixels() -> torch.Tensor:
    return torch.stack([image_to_tensor(image) for image, _ in shape_images(len(PROMPTS), seed=3)])


def _mse(prediction: torch.Tensor, target: torch.Tensor, weighting: torch.Tensor | float = 1.0) -> torch.Tensor:
    """The flow scripts' reduction: `torch.mean((weighting * (pred - target) ** 2).reshape(bsz, -1), 1).mean()`."""
    per_sample = (weighting * (prediction.float() - target.float()) ** 2).reshape(len(target), -1)
    return torch.mean(per_sample, 1).mean()


def _flow_sigmas(pipeline, latents, scheduler_class=None):
    """`get_sigmas(timesteps)`: the scheduler's sigma at each timestep drawn from its own `timesteps` (the pipeline's
    scheduler, or `scheduler_class` over its config, as a script that loads the folder as another class)."""
    scheduler = (scheduler_class or pipeline.scheduler.__class__).from_config(pipeline.scheduler.config)
    timesteps = scheduler.timesteps[TIMESTEP_INDICES]
    sigmas = scheduler.sigmas[TIMESTEP_INDICES].view(-1, *[1] * (latents.dim() - 1))
    return timesteps, sigmas


def sd_script_loss(pipeline, latents, noise, weighting):
    """train_dreambooth_lora.py: `noise_scheduler.add_noise`, the UNet on the first text encoder's states, target
    `noise` (epsilon) or `get_velocity`; `--snr_gamma`: each sample's MSE times min(SNR, gamma) / SNR (epsilon) or
    / (SNR + 1) (v), else `F.mse_loss(..., reduction="mean")`."""
    scheduler = DDPMScheduler.from_config(pipeline.scheduler.config)
    timesteps = TIMESTEP_INDICES.long()
    noisy = scheduler.add_noise(latents, noise, timesteps)
    states = pipeline.encode_prompt(PROMPTS, "cpu", 1, False)[0]
    prediction = pipeline.unet(noisy, timesteps, states, return_dict=False)[0]
    epsilon = scheduler.config.prediction_type == "epsilon"
    target = noise if epsilon else scheduler.get_velocity(latents, noise, timesteps)
    if weighting == "uniform":
        return F.mse_loss(prediction.float(), target.float(), reduction="mean"), timesteps
    snr = compute_snr(scheduler, timesteps)
    weights = torch.stack([snr, 5.0 * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
    weights = weights / snr if epsilon else weights / (snr + 1)
    loss = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=[1, 2, 3]) * weights
    return loss.mean(), timesteps


def sdxl_script_loss(pipeline, latents, noise, weighting):
    """train_dreambooth_lora_sdxl.py: as SD, the UNet also given `time_ids` (original size, crop's top left, target
    size) and the pooled embedding as `text_embeds`."""
    scheduler = DDPMScheduler.from_config(pipeline.scheduler.config)
    timesteps = TIMESTEP_INDICES.long()
    noisy = scheduler.add_noise(latents, noise, timesteps)
    states, _, pooled, _ = pipeline.encode_prompt(PROMPTS, device="cpu", do_classifier_free_guidance=False)
    size = 8 * pipeline.vae_scale_factor
    time_ids = torch.tensor([[size, size, 0, 0, size, size]] * len(PROMPTS), dtype=states.dtype)
    prediction = pipeline.unet(
        noisy, timesteps, states, added_cond_kwargs={"time_ids": time_ids, "text_embeds": pooled}, return_dict=False
    )[0]
    assert weighting == "uniform"
    return F.mse_loss(prediction.float(), noise.float(), reduction="mean"), timesteps


def flux_script_loss(pipeline, latents, noise, weighting):
    """train_dreambooth_lora_flux.py: latents (x - shift) * scale, `(1 - sigma) x + sigma noise`, packed with
    `_pack_latents`, image ids from `_prepare_latent_image_ids`, the transformer at `timesteps / 1000` (no guidance
    input without a guidance embedding), unpacked, target `noise - x`, `compute_loss_weighting_for_sd3`. The prompt
    is encoded at the T5 tokenizer's length (the script's `--max_sequence_length`)."""
    timesteps, sigmas = _flow_sigmas(pipeline, latents)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    b, c, h, w = latents.shape
    packed = FluxPipeline._pack_latents(noisy, b, c, h, w)
    image_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", latents.dtype)
    states, pooled, text_ids = pipeline.encode_prompt(
        PROMPTS, PROMPTS, device="cpu", max_sequence_length=pipeline.tokenizer_2.model_max_length
    )
    prediction = pipeline.transformer(
        hidden_states=packed,
        timestep=timesteps / 1000,
        guidance=None,
        pooled_projections=pooled,
        encoder_hidden_states=states,
        txt_ids=text_ids,
        img_ids=image_ids,
        return_dict=False,
    )[0]
    factor = pipeline.vae_scale_factor
    prediction = FluxPipeline._unpack_latents(prediction, h * factor, w * factor, factor)
    return _mse(prediction, noise - latents, compute_loss_weighting_for_sd3(weighting, sigmas)), timesteps


def flux_kontext_script_loss(pipeline, latents, noise, weighting, control_latents):
    """train_dreambooth_lora_flux_kontext.py: as Flux, the control's latents packed after the noisy ones with position
    ids whose first coordinate is 1, the transformer given `--guidance_scale` (Kontext has a guidance embedding:
    `GUIDANCE` here, difftune's `model.family_options.guidance` on the other side), its prediction cut to the noisy
    tokens."""
    timesteps, sigmas = _flow_sigmas(pipeline, latents)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    b, c, h, w = latents.shape
    image_ids = FluxKontextPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", latents.dtype)
    control_ids = FluxKontextPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", latents.dtype)
    control_ids[..., 0] = 1
    packed = FluxKontextPipeline._pack_latents(noisy, b, c, h, w)
    packed_all = torch.cat([packed, FluxKontextPipeline._pack_latents(control_latents, b, c, h, w)], dim=1)
    states, pooled, text_ids = pipeline.encode_prompt(
        PROMPTS, PROMPTS, device="cpu", max_sequence_length=pipeline.tokenizer_2.model_max_length
    )
    prediction = pipeline.transformer(
        hidden_states=packed_all,
        timestep=timesteps / 1000,
        guidance=torch.tensor([GUIDANCE]).expand(b),
        pooled_projections=pooled,
        encoder_hidden_states=states,
        txt_ids=text_ids,
        img_ids=torch.cat([image_ids, control_ids]),
        return_dict=False,
    )[0]
    factor = pipeline.vae_scale_factor
    prediction = FluxKontextPipeline._unpack_latents(prediction[:, : packed.shape[1]], h * factor, w * factor, factor)
    return _mse(prediction, noise - latents, compute_loss_weighting_for_sd3(weighting, sigmas)), timesteps


def flux2_script_loss(pipeline, latents, noise, weighting, reference=None):
    """train_dreambooth_lora_flux2.py and train_dreambooth_lora_flux2_klein.py: latents patched 2x2
    (`_patchify_latents`) and batch-normalised by the autoencoder's `bn` statistics, `(1 - sigma) x + sigma noise`,
    packed (`_pack_latents`), ids from `_prepare_latent_ids` and the prompt's, the transformer at `timesteps / 1000`
    with `--guidance_scale` where it has a guidance embedding ([dev]; klein's script passes None without one), its
    image tokens unpacked by their ids, target `noise - x`. With a `reference` (their `_img2img.py` scripts): its
    latents (as the target's) packed after the noisy ones, with one sample's `_prepare_image_ids` given to every
    sample (klein's script since diffusers#13923; [dev]'s still numbers a batch's references as one sample's,
    diffusers#13811, where the pipeline numbers each sample's own), the prediction cut to the noisy tokens."""
    timesteps, sigmas = _flow_sigmas(pipeline, latents)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    image_ids = Flux2Pipeline._prepare_latent_ids(latents)
    packed = Flux2Pipeline._pack_latents(noisy)
    tokens, ids = packed, image_ids
    if reference is not None:
        tokens = torch.cat([packed, Flux2Pipeline._pack_latents(reference)], dim=1)
        reference_ids = Flux2Pipeline._prepare_image_ids([reference[0:1]]).expand(len(reference), -1, -1)
        ids = torch.cat([image_ids, reference_ids], dim=1)
    states, text_ids = pipeline.encode_prompt(PROMPTS, device="cpu")
    guidance = torch.full([len(latents)], GUIDANCE) if pipeline.transformer.config.guidance_embeds else None
    prediction = pipeline.transformer(
        hidden_states=tokens,
        timestep=timesteps / 1000,
        guidance=guidance,
        encoder_hidden_states=states,
        txt_ids=text_ids,
        img_ids=ids,
        return_dict=False,
    )[0]
    prediction = Flux2Pipeline._unpack_latents_with_ids(prediction[:, : packed.size(1)], image_ids)
    return _mse(prediction, noise - latents, compute_loss_weighting_for_sd3(weighting, sigmas)), timesteps


def qwen_image_script_loss(pipeline, latents, noise, weighting):
    """train_dreambooth_lora_qwen_image.py: one-frame latents (x - latents_mean) / latents_std, `(1 - sigma) x +
    sigma noise`, permuted and packed with `_pack_latents`, the transformer at `timesteps / 1000` with the prompt's
    mask and `img_shapes`, unpacked with `_unpack_latents`, target `noise - x`."""
    latents, noise = latents[:, :, None], noise[:, :, None]  # the script's (B, C, 1, h, w)
    timesteps, sigmas = _flow_sigmas(pipeline, latents)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    b, c, _, h, w = latents.shape
    packed = QwenImagePipeline._pack_latents(noisy.permute(0, 2, 1, 3, 4), b, c, h, w)
    states, mask = pipeline.encode_prompt(PROMPTS, device="cpu")
    prediction = pipeline.transformer(
        hidden_states=packed,
        encoder_hidden_states=states,
        encoder_hidden_states_mask=mask,
        timestep=timesteps / 1000,
        img_shapes=[(1, h // 2, w // 2)] * b,
        return_dict=False,
    )[0]
    factor = pipeline.vae_scale_factor
    prediction = QwenImagePipeline._unpack_latents(prediction, h * factor, w * factor, factor)
    return _mse(prediction, noise - latents, compute_loss_weighting_for_sd3(weighting, sigmas)), timesteps


def qwen_image21_script_loss(pipeline, latents, noise, weighting):
    """train_dreambooth_lora_qwenimage21.py: one-frame latents of RGBA images (x - latents_mean) * (1 / latents_std),
    `(1 - sigma) x + sigma noise` at the scheduler's unshifted sigmas, flattened unpatched (`_pack_latents`),
    `img_mask` False over the prompt's tokens and True over the h w / 4 target slots, the transformer at `timesteps /
    1000` with the prompt's mask, the prediction's tail unpacked (`_unpack_latents`), target `noise - x`."""
    latents, noise = latents[:, :, None], noise[:, :, None]  # the script's (B, C, 1, h, w)
    timesteps, sigmas = _flow_sigmas(pipeline, latents)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    b, c, _, h, w = latents.shape
    packed = QwenImage21Pipeline._pack_latents(noisy, b, c, h, w)
    states, mask, _ = pipeline.encode_prompt(PROMPTS, device="cpu")
    img_mask = torch.cat(
        [torch.zeros(b, states.shape[1], dtype=torch.bool), torch.ones(b, h * w // 4, dtype=torch.bool)], dim=1
    )
    prediction = pipeline.transformer(
        hidden_states=packed,
        encoder_hidden_states=states,
        encoder_hidden_states_mask=mask,
        timestep=timesteps / 1000,
        img_shapes=[[(1, h, w)]] * b,
        img_mask=img_mask,
        return_dict=False,
    )[0][:, -packed.shape[1] :]
    factor = pipeline.vae_scale_factor
    prediction = QwenImage21Pipeline._unpack_latents(prediction, h * factor, w * factor, factor)
    return _mse(prediction, noise - latents, compute_loss_weighting_for_sd3(weighting, sigmas)), timesteps


def krea2_script_loss(pipeline, latents, noise, weighting):
    """train_dreambooth_lora_krea2.py: one-frame latents (x - latents_mean) * (1 / latents_std), `(1 - sigma) x +
    sigma noise`, packed 2x2 (the pipeline's `_pack_latents`, inlined there), `prepare_position_ids` for the prompt's
    length and the latent grid, the transformer at `timesteps / 1000` with the prompt's mask, unpacked, target
    `noise - x`."""
    timesteps, sigmas = _flow_sigmas(pipeline, latents)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    b, c, h, w = latents.shape
    packed = pipeline._pack_latents(noisy, b, c, h, w)
    states, mask = pipeline.encode_prompt(PROMPTS, device="cpu")
    prediction = pipeline.transformer(
        hidden_states=packed,
        encoder_hidden_states=states,
        timestep=timesteps / 1000,
        position_ids=Krea2Pipeline.prepare_position_ids(states.shape[1], h // 2, w // 2, "cpu"),
        encoder_attention_mask=mask,
        return_dict=False,
    )[0]
    prediction = pipeline._unpack_latents(prediction, h * pipeline.vae_scale_factor, w * pipeline.vae_scale_factor)[
        :, :, 0
    ]
    return _mse(prediction, noise - latents, compute_loss_weighting_for_sd3(weighting, sigmas)), timesteps


def sd3_script_loss(pipeline, latents, noise, weighting):
    """train_dreambooth_lora_sd3.py with `--precondition_outputs 0`: latents (x - shift) * scale, `(1 - sigma) x +
    sigma noise`, the transformer on the unpacked latents at `timesteps` (not divided), target `noise - x`. The
    script's `encode_prompt` is the pipeline's formula (CLIPs' penultimate states side by side, zero-padded to T5's
    width, T5's states after them; pooled: both projections): the pipeline encodes here, at the micro T5's length."""
    timesteps, sigmas = _flow_sigmas(pipeline, latents)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    states, _, pooled, _ = pipeline.encode_prompt(
        PROMPTS,
        PROMPTS,
        PROMPTS,
        device="cpu",
        do_classifier_free_guidance=False,
        max_sequence_length=pipeline.tokenizer_3.model_max_length,
    )
    prediction = pipeline.transformer(
        hidden_states=noisy,
        timestep=timesteps,
        encoder_hidden_states=states,
        pooled_projections=pooled,
        return_dict=False,
    )[0]
    return _mse(prediction, noise - latents, compute_loss_weighting_for_sd3(weighting, sigmas)), timesteps


def z_image_script_loss(pipeline, latents, noise, weighting):
    """train_dreambooth_lora_z_image.py: latents (x - shift) * scale, `(1 - sigma) x + sigma noise`, the transformer
    on a list of one-frame latents at `(1000 - timesteps) / 1000` with each prompt's states (a list), its output
    stacked and negated, target `noise - x`."""
    timesteps, sigmas = _flow_sigmas(pipeline, latents)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    states, _ = pipeline.encode_prompt(list(PROMPTS), device="cpu", do_classifier_free_guidance=False)
    predictions = pipeline.transformer(
        list(noisy.unsqueeze(2).unbind(dim=0)), (1000 - timesteps) / 1000, states, return_dict=False
    )[0]
    prediction = -torch.stack(predictions, dim=0).squeeze(2)
    return _mse(prediction, noise - latents, compute_loss_weighting_for_sd3(weighting, sigmas)), timesteps


def sana_script_loss(pipeline, latents, noise, weighting):
    """train_dreambooth_lora_sana.py: latents `vae.encode(x).latent * scaling_factor` (the autoencoder returns them,
    no posterior), timesteps and sigmas from `FlowMatchEulerDiscreteScheduler.from_pretrained` of the pipeline's
    scheduler folder (its `flow_shift` unread: shift 1), `(1 - sigma) x + sigma noise`, the transformer at the
    timesteps with the prompt's states and mask from `encode_prompt` (given the instruction the pipeline's call
    passes, as difftune reads captions: the script's `--complex_human_instruction`), target `noise - x`."""
    timesteps, sigmas = _flow_sigmas(pipeline, latents, FlowMatchEulerDiscreteScheduler)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    instruction = inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default
    states, mask, *_ = pipeline.encode_prompt(
        PROMPTS, do_classifier_free_guidance=False, device="cpu", complex_human_instruction=instruction
    )
    prediction = pipeline.transformer(
        hidden_states=noisy, encoder_hidden_states=states, encoder_attention_mask=mask, timestep=timesteps
    )[0]
    return _mse(prediction, noise - latents, compute_loss_weighting_for_sd3(weighting, sigmas)), timesteps


def lumina2_script_loss(pipeline, latents, noise, weighting):
    """train_dreambooth_lora_lumina2.py: latents (x - shift) * scale, the scheduler's sigma s drawn as Flux's but
    used as the clean fraction, `(1 - s) noise + s x` (its "reverse lerp"), the transformer at `s` with the prompt's
    padded states and mask (`encode_prompt` with the pipeline's system prompt), target `x - noise`. difftune's noise
    level for the same input is 1 - s, returned as its timesteps."""
    _, clean = _flow_sigmas(pipeline, latents)
    noisy = (1.0 - clean) * noise + clean * latents
    states, mask, *_ = pipeline.encode_prompt(PROMPTS, do_classifier_free_guidance=False, device="cpu")
    prediction = pipeline.transformer(
        hidden_states=noisy,
        encoder_hidden_states=states,
        encoder_attention_mask=mask,
        timestep=clean.flatten(),
        return_dict=False,
    )[0]
    assert weighting == "uniform"  # its other weightings read the reflected s as a noise level
    return _mse(prediction, latents - noise), (1.0 - clean.flatten()) * 1000


def hidream_script_loss(pipeline, latents, noise, weighting):
    """train_dreambooth_lora_hidream.py: latents (x - shift) * scale, the scheduler loaded with `shift=3.0` (the micro
    base's own), `(1 - sigma) x + sigma noise`, the transformer on the latents at `timesteps` (not divided) with the
    pipeline's `encode_prompt` at `--max_sequence_length` 128 (T5's and every Llama layer's states, the CLIPs' pooled
    side by side), `model_pred * -1`, target `noise - x`, `compute_loss_weighting_for_sd3`."""
    timesteps, sigmas = _flow_sigmas(pipeline, latents)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    t5, _, llama, _, pooled, _ = pipeline.encode_prompt(
        PROMPTS, device="cpu", do_classifier_free_guidance=False, max_sequence_length=128
    )
    prediction = (
        pipeline.transformer(
            hidden_states=noisy,
            encoder_hidden_states_t5=t5,
            encoder_hidden_states_llama3=llama,
            pooled_embeds=pooled,
            timesteps=timesteps,
            return_dict=False,
        )[0]
        * -1
    )
    return _mse(prediction, noise - latents, compute_loss_weighting_for_sd3(weighting, sigmas)), timesteps


def _ideogram4_tokens(vae, pixels: torch.Tensor) -> torch.Tensor:
    """train_dreambooth_lora_ideogram4.py's latents: the posterior's mode, `patchify_latents` (a patch's values
    channel last: (p_h, p_w, C)), then `(x - bn.running_mean) / sqrt(bn.running_var + eps)` per token channel."""
    z = vae.encode(pixels).latent_dist.mode()
    b, c, h, w = z.shape
    tokens = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1).reshape(b, (h // 2) * (w // 2), 4 * c)
    return (tokens - vae.bn.running_mean.view(1, 1, -1)) / torch.sqrt(
        vae.bn.running_var + vae.config.batch_norm_eps
    ).view(1, 1, -1)


def ideogram4_script_loss(pipeline, latents, noise, weighting):
    """train_dreambooth_lora_ideogram4.py: its tokens (`_ideogram4_tokens`; difftune's latents are the same values
    with their channels in FLUX.2's patch order, so both sides' latents and noise are read in token order here), sigma
    used as drawn (here the scheduler's at the fixed indices), `(1 - sigma) x + sigma noise` behind
    `max_sequence_length`
    (2048) zeroed text positions, the transformer at model time `1 - sigma` with the pipeline's `encode_prompt` for
    that grid, its prediction at the image positions, target `x - noise`, `compute_loss_weighting_for_sd3`."""
    timesteps, sigmas = _flow_sigmas(pipeline, latents)
    sigmas = sigmas.view(-1, 1, 1)
    x, noise = token_order(latents), token_order(noise)
    noisy = (1.0 - sigmas) * x + sigmas * noise
    h, w = latents.shape[-2:]
    features, position_ids, segment_ids, indicator = pipeline.encode_prompt(PROMPTS, h, w, 2048, "cpu")
    packed = torch.cat([torch.zeros(len(PROMPTS), 2048, x.shape[-1]), noisy], dim=1)
    prediction = pipeline.transformer(
        hidden_states=packed,
        timestep=(1.0 - sigmas).reshape(-1),
        encoder_hidden_states=features,
        position_ids=position_ids,
        segment_ids=segment_ids,
        indicator=indicator,
        return_dict=False,
    )[0][:, 2048:]
    return _mse(prediction, x - noise, compute_loss_weighting_for_sd3(weighting, sigmas)), timesteps


def script_latents(name: str, vae, pixels: torch.Tensor) -> torch.Tensor:
    """The scripts' latents (at the posterior's mode): SD and SDXL `x * scaling_factor`; Flux, Z-Image and SD3
    `(x - shift_factor) * scaling_factor`; Qwen-Image, Krea 2 and Qwen-Image 2.1 (its images RGBA) `(x - latents_mean) *
    (1 / latents_std)` per channel;
    FLUX.2
    patched, then `(x - bn.running_mean) / sqrt(bn.running_var + eps)` per patched channel."""
    if name == "ideogram4":  # in difftune's channel order (FLUX.2's patches), as `ideogram4_script_loss` reads them
        tokens = _ideogram4_tokens(vae, pixels)
        side = int(tokens.shape[1] ** 0.5)
        return patched_order(tokens, side, side)
    if name.startswith("flux2"):
        patched = Flux2Pipeline._patchify_latents(vae.encode(pixels).latent_dist.mode())
        mean, var = (statistic.view(1, -1, 1, 1) for statistic in (vae.bn.running_mean, vae.bn.running_var))
        return (patched - mean) / torch.sqrt(var + vae.config.batch_norm_eps)
    if name == "sana":  # a deterministic autoencoder: its latents, scaled
        return vae.encode(pixels).latent * vae.config.scaling_factor
    if name == "qwen_image21":  # the script's images are RGBA: an RGB image opaque
        pixels = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
    if name in ("qwen_image", "krea2", "qwen_image21"):
        mean = vae.encode(pixels[:, :, None]).latent_dist.mode()[:, :, 0]
        channels = vae.config.z_dim
        return (mean - torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1)) * (
            1.0 / torch.tensor(vae.config.latents_std).view(1, channels, 1, 1)
        )
    mean = vae.encode(pixels).latent_dist.mode()
    return (mean - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor


SCRIPT_LOSSES = {
    "sd": sd_script_loss,
    "sdxl": sdxl_script_loss,
    "flux": flux_script_loss,
    "flux_kontext": flux_kontext_script_loss,
    "flux2": flux2_script_loss,
    "flux2_klein": flux2_script_loss,
    "krea2": krea2_script_loss,
    "qwen_image": qwen_image_script_loss,
    "qwen_image21": qwen_image21_script_loss,
    "sd3": sd3_script_loss,
    "z_image": z_image_script_loss,
    "lumina2": lumina2_script_loss,
    "sana": sana_script_loss,
    "hidream": hidream_script_loss,
    "ideogram4": ideogram4_script_loss,
}
CASES = [
    ("lumina2", "uniform"),
    ("sana", "uniform"),
    ("sana", "sigma_sqrt"),
    ("sd", "uniform"),
    ("sd", "min_snr"),
    ("sdxl", "uniform"),
    ("flux", "uniform"),
    ("flux", "cosmap"),
    ("flux_kontext", "uniform"),
    ("flux2", "uniform"),
    ("flux2", "cosmap"),
    ("flux2_klein", "uniform"),
    ("flux2_klein", "sigma_sqrt"),
    ("krea2", "uniform"),
    ("krea2", "cosmap"),
    ("qwen_image", "uniform"),
    ("qwen_image", "sigma_sqrt"),
    ("qwen_image21", "uniform"),
    ("qwen_image21", "cosmap"),
    ("sd3", "uniform"),
    ("sd3", "sigma_sqrt"),
    ("z_image", "uniform"),
    ("z_image", "cosmap"),
    ("hidream", "uniform"),
    ("hidream", "sigma_sqrt"),
    ("ideogram4", "uniform"),
    ("ideogram4", "cosmap"),
]


def test_every_family_with_a_diffusers_script_is_checked():
    """The families diffusers ships a DreamBooth LoRA script for; those without one (Chroma, the Qwen edit models) are
    checked against their pipelines by the conformance suite."""
    assert set(SCRIPT_LOSSES) == {name for name, _ in CASES} == set(SCRIPTS) | set(LATER_SCRIPTS) <= set(FAMILIES)
    assert set(REFERENCE_SCRIPTS) <= {name for name in SCRIPT_LOSSES if FAMILIES[name].max_controls}


@pytest.mark.parametrize(("name", "weighting"), CASES)
def test_the_loss_is_the_diffusers_training_script_loss(name, weighting, micro_base):
    # An edit family's one script trains its pairs; one with a reference script beside is checked text-to-image here.
    references = bool(FAMILIES[name].max_controls) and name not in REFERENCE_SCRIPTS
    _check_against_the_script(name, weighting, micro_base, references)


@pytest.mark.parametrize("name", REFERENCE_SCRIPTS)
def test_references_train_as_the_diffusers_reference_script(name, micro_base):
    """A text-to-image family's edit pairs against its `_img2img.py` script: the other image's latents the reference."""
    _check_against_the_script(name, "uniform", micro_base, references=True)


def _check_against_the_script(name: str, weighting: str, micro_base, references: bool) -> None:
    """difftune's loss and the script's on the same inputs; with `references`, an edit pair's (the batch's images in
    the other order its controls)."""
    components = load_components(ModelConfig(base=str(micro_base(name))))
    family, pipeline = FAMILIES[name], components.pipeline()
    pixels = _pixels()
    with torch.no_grad():
        theirs_latents = script_latents(name, pipeline.vae, pixels)
        latents = reference_latents(encode_posterior(components.vae, pixels)[0], components.latent_normalization)
        torch.testing.assert_close(latents, theirs_latents, rtol=1e-5, atol=1e-6)
        noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))
        conditioning = family.conditioning.encode_prompts(
            components, family.conditioning.tokenize(components.tokenizers, PROMPTS)
        )
        controls = ()
        if references:
            control = reference_latents(
                encode_posterior(components.vae, pixels.flip(0))[0], components.latent_normalization
            )
            conditioning["control_latents"], controls = [control], (control,)
        if getattr(components.denoiser.config, "guidance_embeds", False):  # the scripts' `--guidance_scale`
            components.family_options = components.family_options.model_copy(update={"guidance": GUIDANCE})
        theirs, timesteps = SCRIPT_LOSSES[name](pipeline, latents, noise, weighting, *controls)
        geometry = torch.tensor([[32, 32, 0, 0, 32, 32]] * len(PROMPTS))
        ours = family.objective.loss(
            components,
            latents,
            timesteps.float() if name not in ("sd", "sdxl") else timesteps,
            noise,
            conditioning,
            geometry,
            LossConfig(weighting=weighting, snr_gamma=5.0),
        ).mean()
    assert theirs > 0
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-5, atol=1e-7)
