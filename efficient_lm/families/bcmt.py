"""The configs of BCMT and its ablation HOnly: the block, and the memory's decay (models/bcmt.py
builds their mixers)."""

import dataclasses

from efficient_lm.config import fields as tc
from efficient_lm.config.errors import divisors_near
from efficient_lm.config.model import ModelConfig
from efficient_lm.ops.pattern import Pattern


def _near(divisors: list[int]) -> str:
  return f"{', '.join(map(str, divisors[:-1]))} or {divisors[-1]}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HOnlyConfig(ModelConfig):
  """HOnly, BCMT's ablation: block-local attention alone."""
  block_size: int = tc.setting(256, "L: local attention and summaries per block; divides seq_len",
                               tc.positive_int())
  alpha: float = tc.setting(0.8, "memory decay per block, in (0, 1); unused by honly")

  RULES = (tc.Rule("model.block_size", lambda c: c.seq_len % c.block_size == 0,
                    "must divide data.seq_len={seq_len}",
                    "use a divisor of {seq_len} such as {near}, or change data.seq_len",
                    derive=lambda c: {"near": _near(divisors_near(c.seq_len, c.block_size))}),)

  def patterns(self, seq_len: int | None = None) -> tuple[Pattern, ...]:
    del seq_len
    return (Pattern.blocks(self.block_size),)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BCMTConfig(HOnlyConfig):
  """BCMT: HOnly's blocks plus the exponential memory of earlier blocks."""
  alpha: float = tc.setting(0.8, "memory decay per block, in (0, 1)",
                            tc.number_in(0.0, 1.0, low_open=True, high_open=True, floats_only=True,
                                         fix="set model.alpha to e.g. 0.8 (the paper's value)"))


MODELS = {
    "bcmt": (BCMTConfig, "bcmt",
             "BCMT: blockwise local attention + a decaying memory of earlier blocks"),
    "honly": (HOnlyConfig, "bcmt:honly", "BCMT without its memory (the paper's ablation)"),
}
