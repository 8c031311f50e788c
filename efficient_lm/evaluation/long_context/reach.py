"""How long an input each model can take, as its config declares it (`ModelConfig.input_limit`,
which a family's config class may state anew beside its fields):

- Learned positions (any family, `model.position='learned'`): at most `model.seq_len` positions,
  the table's size; a needle's answer must fit too.
- A fixed window (the Perceiver-AR family: `PerceiverARConfig.input_limit`): at most
  `model.seq_len` tokens; a history of seq_len - num_latents tokens, then the latents, and
  generation keeps a prompt's last seq_len tokens, so a longer haystack would be cut, not read.
- Bounded reach with RoPE (sliding window, π, BCMT/HOnly, ECP: every attention pattern of the model
  reads a bounded span, `ModelConfig.chunkable`): any length; each token sees what it saw in training.
- A recurrence (Gated DeltaNet: `GatedDeltaNetConfig.input_limit`): any length; a state of fixed
  size per head, its hybrid layers' attention of bounded reach.
- Dense attention with RoPE: any length, out of distribution past seq_len (positions it never
  trained on): allowed, with one warning line.
"""

from efficient_lm.config.run import RunConfig


class LengthError(ValueError):
  """A length the model cannot run; the message names the rule and the fix."""


def limit(config: RunConfig) -> tuple[int | None, str, str | None]:
  """(the most tokens one input may hold, or None for any; the rule in words; a warning for
  lengths past `model.seq_len`, or None)."""
  cfg = config.model
  most, rule = cfg.input_limit()
  if most is not None or cfg.chunkable:
    return most, rule, None
  return None, rule, (f"warning: model.name={cfg.name!r} (dense attention) past model.seq_len="
                      f"{cfg.seq_len} is out of distribution: RoPE positions it never trained on")


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
