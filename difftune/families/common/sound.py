"""What the families whose pipelines draw video with sound share (LTX-2's, MiniMax-H3's), where a run trains the
sound too (`model.family_options.sound`): the audio autoencoder loaded as an encoder of the latent cache (not left out
with the drawing parts) and named in its entries' identity, and the settings such a run needs."""

from __future__ import annotations

from difftune.config import Config, ModelConfig
from difftune.data.cache import model_identity
from difftune.families.common.conditioning import Conditioning
from difftune.families.common.loading import FamilyOptions, Loading
from difftune.models.components import Components

AUDIO_ENCODER = "audio_vae"  # the pipelines' name for their audio autoencoder


class SoundLoading(Loading):
    """Before the family's loading in its bases: with sound, the audio autoencoder an encoder (`pixel_encoders`),
    loaded with the base, kept and released with the video's."""

    def drawing_part_names_of(self, config: ModelConfig) -> tuple[str, ...]:
        names = self.family.drawing_part_names
        return tuple(name for name in names if name != AUDIO_ENCODER) if self.family.options(config).sound else names

    def components_of(self, pipeline, options: FamilyOptions) -> Components:
        components = super().components_of(pipeline, options)
        if options.sound:
            components.pixel_encoders[AUDIO_ENCODER] = components.drawing_parts.pop(AUDIO_ENCODER)
        return components


class SoundConditioning(Conditioning):
    def trains_sound(self, components: Components) -> bool:
        return components.family_options.sound

    def latent_identity(self, components: Components) -> str:
        identity = super().latent_identity(components)
        if not self.trains_sound(components):
            return identity
        return f"{identity}+sound+{model_identity(components.pixel_encoders[AUDIO_ENCODER])}"


def sound_setting_problems(config: Config) -> list[str]:
    """What a run with sound refuses: the sound is cached beside the frames, and trains by the plain loss alone."""
    needs_off = {
        "cache.latents must be on (the sound is cached beside the frames)": config.cache.latents != "on",
        "preference.method must be off": config.preference.method != "off",
        "slider.enabled must be false": config.slider.enabled,
    }
    return [f"model.family_options.sound: {need}" for need, unmet in needs_off.items() if unmet]
