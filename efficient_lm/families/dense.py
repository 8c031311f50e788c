"""The dense baseline's config: the shared fields alone, causal attention over the whole window."""

import dataclasses

from efficient_lm.config.model import ModelConfig
from efficient_lm.ops.pattern import Pattern


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseConfig(ModelConfig):
  """The dense baseline has no fields of its own."""

  def patterns(self, seq_len: int | None = None) -> tuple[Pattern, ...]:
    del seq_len
    return (Pattern.dense(),)


MODELS = {"dense": (DenseConfig, "dense",
                    "causal softmax attention over the whole window (the baseline)")}
