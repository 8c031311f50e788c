"""The config of ECP: the window in pieces, each attending to the previous one (models/ecp.py builds
its mixer)."""

import dataclasses

from efficient_lm.config import fields as tc
from efficient_lm.config.errors import divisors_near
from efficient_lm.config.model import ModelConfig
from efficient_lm.ops.pattern import Pattern

_FLAG = tc.boolean("set {field}=False (the default) or True")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ECPConfig(ModelConfig):
  """ECP: the window in `num_segments` pieces, each attending to the previous one."""
  num_segments: int = tc.setting(4, "pieces per window (must divide seq_len): 64 tokens at "
                                 "seq_len 256", tc.positive_int())
  shared_kv: bool = tc.setting(False, "keys and values from one projection (as the authors' "
                               "code)", _FLAG)
  rope_first_layer_only: bool = tc.setting(False, "RoPE in layer 1 only (as the authors' code); "
                                           "else every layer", _FLAG)

  RULES = (tc.Rule("model.num_segments", lambda c: c.seq_len % c.num_segments == 0,
                    "must divide model.seq_len={seq_len}",
                    "set model.num_segments to a divisor of {seq_len}, e.g. {near}",
                    derive=lambda c: {"near": " or ".join(
                        map(str, divisors_near(c.seq_len, c.num_segments, 2)))}),)

  def patterns(self, seq_len: int | None = None) -> tuple[Pattern, ...]:
    return (pattern(self, seq_len),)

  @property
  def identical_layers(self) -> bool:
    return not (self.rope_first_layer_only and self.position == "rope")


def pattern(cfg: ECPConfig, seq_len: int | None = None) -> Pattern:
  """Each piece attends to the previous piece and causally to itself (at `seq_len`, default the
  model's)."""
  return Pattern.blocks((seq_len or cfg.seq_len) // cfg.num_segments, lookback=1)


MODELS = {"ecp": (ECPConfig, "ecp",
                  "ECP: each piece attends to the previous piece and causally to itself")}
