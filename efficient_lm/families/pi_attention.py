"""The configs of π-Attention and its baseline, sliding-window attention: the window, the periodic
skips and the gate between them (models/pi_attention.py builds their mixers)."""

import dataclasses

from efficient_lm.config import fields as tc
from efficient_lm.config.model import ModelConfig
from efficient_lm.ops.pattern import Pattern

PERIOD_SCHEDULES = ("constant", "doubling")
GATES = ("learned", "fixed")  # model.gate: the gate MLP, or g = 0.5 everywhere (no parameters)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlidingWindowConfig(ModelConfig):
  """The sliding-window baseline: the local window alone."""
  window: int = tc.setting(128, "local window: token i sees i - window < j <= i",
                           tc.positive_int())

  def patterns(self, seq_len: int | None = None) -> tuple[Pattern, ...]:
    del seq_len  # the window is the same at any length
    return (Pattern.sliding(self.window),)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PiAttentionConfig(SlidingWindowConfig):
  """π-Attention: the window, periodic skips, and the gate between them."""
  period: int = tc.setting(128, "skip distance: token i also sees i - m * period ...",
                           tc.positive_int())
  num_skips: int = tc.setting(3, "... for m = 1..num_skips (skips inside the window not repeated)",
                              tc.non_negative_int(fix="set model.num_skips to e.g. 4 (0 = window "
                                                  "only)"))
  period_schedule: str = tc.setting("constant", "'constant', or 'doubling': layer l uses "
                                    "period * 2**l", tc.one_of(PERIOD_SCHEDULES,
                                                               "is not a known schedule"))
  gate_hidden: int = tc.setting(32, "hidden width of the gate MLP (D -> gate_hidden -> heads)",
                                tc.positive_int())
  gate: str = tc.setting("learned", "'learned' (the gate MLP), or 'fixed': g = 0.5, no gate "
                         "parameters", tc.one_of(GATES, "is not a known gate",
                                                 "use 'learned' (the gate MLP) or 'fixed' (g = "
                                                 "0.5: window and skips weighed equally)"))

  def patterns(self, seq_len: int | None = None) -> tuple[Pattern, ...]:
    del seq_len  # the window and the skips are the same at any length
    found = []
    for layer in range(self.num_layers):
      pattern = layer_pattern(self, layer)
      if pattern not in found:
        found.append(pattern)
    return tuple(found)

  def layer_patterns(self, seq_len: int | None = None) -> tuple[Pattern, ...]:
    del seq_len
    return tuple(layer_pattern(self, layer) for layer in range(self.num_layers))

  @property
  def identical_layers(self) -> bool:
    return self.period_schedule == "constant"


def layer_period(cfg: PiAttentionConfig, layer: int) -> int:
  return cfg.period * 2 ** layer if cfg.period_schedule == "doubling" else cfg.period


def layer_pattern(cfg: PiAttentionConfig, layer: int) -> Pattern:
  """π's pattern of `layer`: the window and the layer's skips."""
  return Pattern.pi(cfg.window, layer_period(cfg, layer), cfg.num_skips)


MODELS = {
    "pi_attention": (PiAttentionConfig, "pi_attention",
                     "π-Attention: a local window + periodic skips, gated"),
    "sliding_window": (SlidingWindowConfig, "sliding_window",
                       "attention over the last model.window tokens"),
}
