"""How long an input each model can take: the one place the families' rules live.

- Learned positions (any family, `model.position='learned'`): at most `model.seq_len` positions,
  the table's size; a needle's answer must fit too.
- The Perceiver-AR family: at most `model.seq_len` tokens; its window is fixed (a history of
  seq_len - num_latents tokens, then the latents), and generation keeps a prompt's last seq_len
  tokens, so a longer haystack would be cut, not read.
- Bounded reach with RoPE (sliding window, π, BCMT/HOnly, ECP: every attention pattern of the model
  reads a bounded span, `ModelConfig.chunkable`): any length; each token sees what it saw in training.
- Dense attention with RoPE: any length, out of distribution past seq_len (positions it never
  trained on): allowed, with one warning line.
"""

from efficient_lm.config.run import RunConfig
from efficient_lm.families import perceiver_ar


class LengthError(ValueError):
  """A length the model cannot run; the message names the rule and the fix."""


def limit(config: RunConfig) -> tuple[int | None, str, str | None]:
  """(the most tokens one input may hold, or None for any; the rule in words; a warning for
  lengths past `model.seq_len`, or None)."""
  cfg = config.model
  seq_len = cfg.seq_len
  if cfg.position == "learned":
    return seq_len, (f"model.position='learned' has a table of model.seq_len={seq_len} positions "
                     "and none past it"), None
  if cfg.name in perceiver_ar.VARIANTS:
    return seq_len, (f"model.name={cfg.name!r} reads a fixed window of model.seq_len={seq_len} "
                     f"tokens (a history of seq_len - num_latents = {seq_len - cfg.num_latents}, "
                     "then the latents); a longer input is cut to its last seq_len tokens"), None
  if cfg.chunkable:
    return None, f"model.name={cfg.name!r} has attention of bounded reach (RoPE): any length", None
  return None, f"model.name={cfg.name!r} attends to every earlier position (RoPE): any length", (
      f"warning: model.name={cfg.name!r} (dense attention) past model.seq_len={seq_len} is out of "
      "distribution: RoPE positions it never trained on")


def check(config: RunConfig, lengths, *, extra: int = 0, flag: str = "--lengths") -> str | None:
  """A `LengthError` for the first of `lengths` (tokens) the model cannot take; returns the
  warning line for lengths past seq_len, or None. `extra`: tokens generated after each input (a
  needle's answer), which need positions of their own in a learned table."""
  most, rule, warning = limit(config)
  seq_len = config.model.seq_len
  extra = extra if config.model.position == "learned" else 0
  for length in lengths:
    if most is not None and length + extra > most:
      fits = most - extra
      raise LengthError(f"{flag}: {length} tokens{f' (+{extra} of answer)' if extra else ''} do "
                        f"not fit: {rule}; give lengths of at most {fits}")
  return warning if any(length > seq_len for length in lengths) else None
