"""The config of the Perceiver-AR family: Perceiver AR and the three double-attention variants
(`VARIANTS`, by `model.name`), their latents, the history's compression and its segments
(models/perceiver_ar.py builds them)."""

import dataclasses

from efficient_lm.config import fields as tc
from efficient_lm.config.errors import divisors_near
from efficient_lm.config.model import ModelConfig
from efficient_lm.ops.pattern import Pattern


@dataclasses.dataclass(frozen=True)
class Variant:
  refine_history: bool  # keep the history in every layer, refined by its own self-attention
  compress: bool        # compress the history along the sequence before layer 1
  split_history: bool   # history self-attention inside num_history_segments segments


VARIANTS = {
    "perceiver_ar": Variant(refine_history=False, compress=False, split_history=False),
    "double_attention": Variant(refine_history=True, compress=False, split_history=False),
    "compressed_double_attention": Variant(refine_history=True, compress=True, split_history=False),
    "ssplit_double_attention": Variant(refine_history=True, compress=False, split_history=True),
}
COMPRESSION_OPS = ("learned", "strided")


def _history(cfg) -> int:
  return cfg.seq_len - cfg.num_latents


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerceiverARConfig(ModelConfig):
  """Every variant of the family (`VARIANTS`, by `model.name`); a variant reads only its fields."""
  num_latents: int = tc.setting(128, "latents: the last num_latents positions, the only ones "
                                "predicted", tc.positive_int())
  compression: int = tc.setting(4, "compressed: history length / compression slots (must divide "
                                "it)", tc.positive_int())
  compression_op: str = tc.setting(
      "learned", "compressed: 'learned' (the paper's map over the whole history: O(T^2) "
      "parameters) or 'strided' (one weight per position of each group: O(compression * "
      "d_model))", tc.one_of(COMPRESSION_OPS, "is not a known compression",
                             "use 'learned' (the paper's map over the whole history, O(T^2) "
                             "parameters) or 'strided' (one weight per position of each group, "
                             "O(compression * d_model))"))
  num_history_segments: int = tc.setting(4, "ssplit: history segments (must divide seq_len - "
                                         "num_latents)", tc.positive_int())

  @property
  def variant(self) -> Variant:
    return VARIANTS[self.name]

  RULES = (
      tc.Rule("model.num_latents", lambda c: c.num_latents <= c.seq_len,
              "must be at most model.seq_len={seq_len}",
              "set model.num_latents to at most {seq_len}, e.g. {half}",
              derive=lambda c: {"half": max(1, c.seq_len // 2)}),
      *(tc.Rule(f"model.{field}", lambda c, f=field: _history(c) % getattr(c, f) == 0,
                "must divide the history length model.seq_len - model.num_latents = {history}",
                f"set model.{field} to a divisor of {{history}}, e.g. {{near}}",
                when=lambda c, u=used: getattr(c.variant, u),
                derive=lambda c, f=field: {"history": _history(c), "near": divisors_near(
                    _history(c), getattr(c, f), 1)[0]})
        for used, field in (("compress", "compression"),
                            ("split_history", "num_history_segments"))),
  )

  @property
  def flops_counted(self) -> bool:
    """No: after layer 1 `perceiver_ar` keeps only the latents, and every variant predicts only
    them, so parameters x tokens overcounts (7x XLA's count of the step at 2,048 tokens and 256
    latents, experiments/results/scaling.json): no MFU."""
    return False

  def input_limit(self) -> tuple[int | None, str]:
    """A fixed window of model.seq_len tokens (a history, then the latents): generation keeps a
    prompt's last seq_len tokens, so a longer input would be cut, not read."""
    most, rule = super().input_limit()
    if most is not None:  # (learned positions: the table's limit, the same number)
      return most, rule
    return self.seq_len, (f"model.name={self.name!r} reads a fixed window of model.seq_len="
                          f"{self.seq_len} tokens (a history of seq_len - num_latents = "
                          f"{_history(self)}, then the latents); a longer input is cut to its last "
                          "seq_len tokens")

  def patterns(self, seq_len: int | None = None) -> tuple[Pattern, ...]:
    """The latents' causal attention over the stream, and (variants that refine the history) the
    history's segments at its length in the stream (compressed, if the variant compresses)."""
    history = (seq_len or self.seq_len) - self.num_latents
    history //= self.compression if self.variant.compress else 1
    segments = self.num_history_segments if self.variant.split_history else 1
    found = (Pattern.dense(),)
    if self.variant.refine_history and history > 0:
      found += (Pattern.segments(max(1, history // segments)),)
    return found


# `--help`'s line of each variant: the config that trains it and what it is.
_LINES = {
    "perceiver_ar": ("perceiver_ar", "Perceiver AR: the last model.num_latents tokens are queries"),
    "double_attention": ("perceiver_ar:double", "Perceiver-AR, its history refined in every layer"),
    "compressed_double_attention": ("perceiver_ar:compressed",
                                    "double attention over a history compressed by a learned map"),
    "ssplit_double_attention": (
        "perceiver_ar:ssplit", "double attention, the history's inside model.num_history_segments"),
}
MODELS = {name: (PerceiverARConfig, *_LINES[name]) for name in VARIANTS}
