"""Building the bundled tiny sound base (models/tiny-ace_step): ACE-Step's classes at toy size (its micro builders)
trained on tones (toy/tones.py) as the tiny image bases are trained on the shapes. Its autoencoder is trained by a
plain reconstruction loop on tones of every pitch (the held-out one too, as an image base's autoencoder sees every
color); then its transformer by difftune's own trainer (a full fine-tune from its random init, tiny_base's job; the
Qwen3 text encoder and the condition encoder stay at theirs, as tiny-flux's T5) on the heard pitches' tones alone, so
that fine-tuning can be judged on a pitch the base never played (`HELD_OUT_PITCH`, toy/tone_judge.py).

The reconstruction loss is the waveform's L1 and, as Stable Audio's autoencoder is trained, spectral L1s at three
resolutions (of magnitudes and of compressed magnitudes, log(1 + |X|)): a waveform loss alone blurs a tone's
harmonics, which are its timbre. Not the log of magnitudes floored at 1e-4 that real audio is trained with: a tone
leaves most frequencies silent, and matching those pulled the decoder's output to near silence (its level 0.001 of
the tones' after 1,000 steps).

The posterior starts narrow (`SCALE_BIAS`): at the default, a spread of 0.69, its samples drowned the latents and
the decoder learned their average, a single pitch for every tone. With that, a 1e-6 KL weight, a learning rate of
5e-4 (2e-3 collapsed too) and tones that start at phase 0 (toy/tones.py), 4,000 steps (about 13 minutes on 2 CPU
cores) make the tones again at 16 dB signal to noise: every pitch as the tone judge names it, every timbre but the
middle buzz's (its third harmonic, at 1,200 Hz, comes back at a sixteenth of its level). Probes at 1,500 steps with
tones at random phases (a wider latent, 16 channels; log-magnitude losses alone) made the low tones as silence in
each.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from difftune.config import ModelConfig, load_config
from difftune.data.clips import Sound
from difftune.families import FAMILIES, load_components
from difftune.toy.micro import builder
from difftune.toy.tiny_base import (
    Recipe,
    as_published,
    base_training_overrides,
    cosine_lr,
    timed,
    write_untrained_control,
)
from difftune.toy.tone_judge import judge_tone
from difftune.toy.tones import (
    HEARD_PITCHES,
    PITCHES,
    TIMBRES,
    TONE_SECONDS,
    render_tone,
    tone_sounds,
    write_sound_folder,
)
from difftune.training.metrics import read_metrics

SPECTRAL_SIZES = (64, 256, 1024)  # FFT sizes of the spectral losses: 10 ms to 160 ms at 6.4 kHz
SCALE_BIAS = -6.0  # the encoder's output bias for the posterior's scale at init: a spread of softplus(-6), 0.0025


@dataclass
class SoundRecipe(Recipe):
    """How the tiny sound base is made (`family`: the sound family whose micro builders it trains); the defaults are
    what `scripts/make_tiny_sound_base.py` commits."""

    seconds: float = TONE_SECONDS  # each tone, window and sample
    vae_steps: int = 4000
    vae_batch: int = 16
    vae_learning_rate: float = 5e-4
    vae_decoder_channels: int = 32
    vae_seconds: float = 0.25  # each tone it trains on: a convolution reads a quarter second as it reads a whole one
    kl_weight: float = 1e-6
    tones_per_prompt: int = 100  # the denoiser's training tones per heard prompt
    validation_tones_per_prompt: int = 4
    steps: int = 1500
    batch_size: int = 64
    learning_rate: float = 1e-3
    weighting: str = "auto"
    noise_offset: float = 0.0  # a sound's frames are not an image's pixels: no mean to read the noise's color from
    # The text encoder and condition encoder kept at their random init, their sequences cached: the condition encoder
    # reads 30 s of silence for its timbre at every call (6,000 latent frames here), which in every step of a batch
    # of 64 would be most of the training's time.
    train_text_encoder: bool = False
    dit_layers: int = 4
    dit_heads: int = 4


def tone_batch(count: int, rate: int, seconds: float, rng: np.random.Generator) -> torch.Tensor:
    """`count` tones (2, samples) of every pitch and timbre at random, a twentieth of them silence."""
    tones = []
    for _ in range(count):
        if rng.random() < 0.05:
            tones.append(np.zeros((2, round(seconds * rate)), np.float32))
            continue
        pitch, timbre = rng.choice(list(PITCHES)), rng.choice(TIMBRES)
        tones.append(render_tone(PITCHES[pitch], timbre, seconds, rate, rng).samples)
    return torch.from_numpy(np.stack(tones))


def reconstruction_loss(reconstructed: torch.Tensor, sound: torch.Tensor) -> torch.Tensor:
    """The waveform's L1 and the spectral L1s (see the module's docstring)."""
    loss = F.l1_loss(reconstructed, sound)
    for size in SPECTRAL_SIZES:
        window = torch.hann_window(size, device=sound.device)
        ours, theirs = (
            torch.stft(x.flatten(0, 1), size, size // 4, window=window, return_complex=True).abs()
            for x in (reconstructed, sound)
        )
        loss = loss + F.l1_loss(ours, theirs) + F.l1_loss(torch.log1p(ours), torch.log1p(theirs))
    return loss


def train_sound_vae(recipe: SoundRecipe):
    """The family's micro autoencoder trained on fresh tones each step (posterior samples decoded, plus a small KL
    term), its learning rate on a cosine schedule."""
    torch.manual_seed(recipe.seed)
    vae = builder(recipe.family).sound_autoencoder(recipe.vae_decoder_channels)
    with torch.no_grad():  # the posterior's scale is the second half of the encoder's output channels
        vae.encoder.conv2.bias[vae.config.decoder_input_channels :] = SCALE_BIAS
    rate, rng = vae.config.sampling_rate, np.random.default_rng(recipe.seed + 100)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=recipe.vae_learning_rate)
    for step in tqdm(range(recipe.vae_steps), desc="autoencoder"):
        cosine_lr(optimizer, recipe.vae_learning_rate, step, recipe.vae_steps)
        sound = tone_batch(recipe.vae_batch, rate, recipe.vae_seconds, rng)
        posterior = vae.encode(sound).latent_dist
        loss = reconstruction_loss(vae.decode(posterior.sample()).sample, sound) + recipe.kl_weight * posterior.kl()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return vae.eval()


@torch.no_grad()
def sound_autoencoder_scores(vae, seed: int, per_prompt: int = 10, seconds: float = 1.0) -> dict:
    """How its reconstructions (of the posterior's mean) are judged: the fraction judged as the tone was, per pitch,
    and their signal-to-noise ratio in dB; and its latents' spread."""
    rate, rng = vae.config.sampling_rate, np.random.default_rng(seed)
    judged: dict[str, list[bool]] = {pitch: [] for pitch in PITCHES}
    signal, noise, latents = 0.0, 0.0, []
    for pitch in PITCHES:
        for timbre in TIMBRES:
            for _ in range(per_prompt):
                tone = render_tone(PITCHES[pitch], timbre, seconds, rate, rng).samples
                latent = vae.encode(torch.from_numpy(tone)[None]).latent_dist.mean
                back = vae.decode(latent).sample[0].numpy()
                judged[pitch].append(judge_tone(Sound(back, rate)) == (pitch, timbre))
                signal, noise = signal + float((tone**2).sum()), noise + float(((back - tone) ** 2).sum())
                latents.append(latent)
    return {
        "judged_as_the_tone": {pitch: float(np.mean(found)) for pitch, found in judged.items()},
        "snr_db": round(10 * np.log10(signal / noise), 2),
        "latent_std": round(float(torch.cat(latents).std()), 3),
    }


def write_tones(folder: Path, per_prompt: int, seed: int, seconds: float, rate: int) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    write_sound_folder(folder, tone_sounds(per_prompt * len(HEARD_PITCHES) * len(TIMBRES), seed, seconds, rate))
    return folder


def build_sound_base(out_dir: Path, work_dir: Path, recipe: SoundRecipe) -> dict:
    """Train everything and write the pipeline folder (fp16); returns the facts for the model card (the autoencoder's
    scores, seconds per stage, the recipe, the validation losses)."""
    seconds: dict[str, float] = {}
    work_dir.mkdir(parents=True, exist_ok=True)
    with timed(seconds, "autoencoder"):
        vae = train_sound_vae(recipe)
    scores = sound_autoencoder_scores(vae, recipe.seed + 999)
    print(f"autoencoder: {scores}", flush=True)  # before the denoiser's minutes: a failed one is seen at once
    init_dir = work_dir / "init"
    init = write_untrained_control(vae, recipe, init_dir)  # its learned silence: the trained autoencoder's
    rate = vae.config.sampling_rate
    data_dir = write_tones(work_dir / "train", recipe.tones_per_prompt, recipe.seed + 1, recipe.seconds, rate)
    validation_dir = write_tones(
        work_dir / "validation", recipe.validation_tones_per_prompt, recipe.seed + 2, recipe.seconds, rate
    )
    run_dir = work_dir / "run"
    overrides = base_training_overrides(recipe, init_dir, data_dir, validation_dir, run_dir, work_dir / "cache")
    with timed(seconds, "denoiser"):
        from difftune.training.train import train

        train(load_config(None, [*overrides, f"model.family_options={{seconds = {recipe.seconds}}}"]))
    pipeline = load_components(ModelConfig(base=str(run_dir / "model_ema"))).pipeline(init.scheduler)
    shutil.rmtree(out_dir, ignore_errors=True)
    FAMILIES[recipe.family].loading.save_pipeline(pipeline.to(torch.float16), out_dir)
    as_published(out_dir)
    validation = [
        {key: row[key] for key in ("step", "val_loss", "val_loss_ema")}
        for row in read_metrics(run_dir)
        if "val_loss" in row
    ]
    return {"recipe": asdict(recipe), "seconds": seconds, "autoencoder": scores, "validation_loss": validation}
