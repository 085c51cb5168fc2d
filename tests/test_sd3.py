"""SD3 / SD3.5 beyond the conformance suite: which transformers the default targets fit."""

import pytest
from diffusers import SD3Transformer2DModel

from difftune.adapters.targets import missing_targets
from difftune.families import FAMILIES
from difftune.families.sd3.micro import build_sd3_transformer


@pytest.mark.parametrize("second_attention", [(0,), ()], ids=["sd35-medium", "sd3-medium-and-sd35-large"])
def test_the_default_targets_name_modules_of_every_sd3_transformer(second_attention):
    """SD3.5 Medium's first blocks have a second image attention (`attn2`), SD3 Medium's and SD3.5 Large's none: the
    default targets adapt it where it is, and name nothing missing where it is not (SD3.5 Large's job was refused:
    "'attn2.to_q' ... names no module of the transformer")."""
    config = dict(build_sd3_transformer().config) | {"dual_attention_layers": second_attention}
    transformer = SD3Transformer2DModel.from_config(config)
    targets = FAMILIES["sd3"].targets.targets_of("transformer", transformer)
    assert not missing_targets(targets, (name for name, _ in transformer.named_modules()))
    assert any(target.startswith("attn2.") for target in targets) == bool(second_attention)
    assert {"attn.to_q", "attn.add_q_proj", "ff.net.2", "ff_context.net.2"} <= set(targets)
