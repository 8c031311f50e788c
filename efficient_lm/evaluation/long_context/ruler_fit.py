"""Fitting a RULER prompt to a length in the model's own tokens (`long_context.ruler`).

RULER grows a prompt's haystack in steps until the prompt fills the target length in its
tokenizer's tokens. Here the count is the model's tokenizer's, and the step is one token: a
haystack is a list of units (sentences of held-out text, repeats of the noise sentence, distractor
needles), each with its tokens; `Filler.take(h)` keeps the whole units that fit in h tokens and
the first tokens of the next one. `fit` finds the value of such a parameter whose prompt is the
longest that fits: the prompt is then the target length, or a token or two short of it where the
tokenizer merges across a boundary. The prompt is text, and its tokens are `encode(text)`: what a
model fed the text (here or through lm-eval) reads.
"""

from typing import Callable

import numpy as np

TOLERANCE = 0.02  # a prompt holds at least (1 - TOLERANCE) x its target tokens


class RulerError(ValueError):
  """A RULER prompt that cannot be built as asked; the message names the flag and the fix."""


class Filler:
  """Haystack units (strings) and their tokens, standalone. `take(h)`: (the number n of whole
  units whose tokens add up to at most h, the text of the next unit's first h - (their tokens)
  tokens, '' when none)."""

  def __init__(self, tokenizer, units: list[str]):
    self.tokenizer = tokenizer
    self.units = list(units)
    self.ids = tokenizer.encode_batch(self.units) if self.units else []
    self.cum = np.concatenate([[0], np.cumsum([len(i) for i in self.ids], dtype=np.int64)])

  @property
  def tokens(self) -> int:
    return int(self.cum[-1])

  def take(self, h: int) -> tuple[int, str]:
    n = min(int(np.searchsorted(self.cum, h, side="right")) - 1, len(self.units))
    rest = int(h - self.cum[n])
    if n == len(self.units) or rest <= 0:
      return n, ""
    return n, self.tokenizer.decode(self.ids[n][:rest])


def weave(units: list[str], partial: str, inserts: list[tuple[float, str]], sep: str) -> str:
  """The context: `units` with each insert (depth in [0, 1], text) placed before unit
  int(len(units) * depth) (after the last at depth 1), then `partial`, joined by `sep`; with sep
  '' (units that keep their own trailing whitespace: sentences of text) an insert is followed by
  a space."""
  n = len(units)
  at: dict[int, list[str]] = {}
  for depth, text in sorted(inserts, key=lambda d: d[0]):
    at.setdefault(min(int(n * depth), n), []).append(text + (" " if sep == "" else ""))
  pieces = []
  for i in range(n + 1):
    pieces.extend(at.get(i, ()))
    if i < n:
      pieces.append(units[i])
  if partial:
    pieces.append(partial)
  return sep.join(pieces)


def fit(render: Callable[[int], str], encode, target: int, most: int, what: str
        ) -> tuple[int, str, np.ndarray]:
  """(h, text, tokens) of the longest prompt `render(h)`, h in [0, most], that encodes to at most
  `target` tokens (the least such h), the tokens growing with h: a search that starts where the
  slope points and bisects. A `RulerError` naming `what` when even h = 0 is too long."""
  seen: dict[int, tuple[str, np.ndarray]] = {}

  def size(h: int) -> int:
    if h not in seen:
      text = render(h)
      seen[h] = (text, np.asarray(encode(text)))
    return len(seen[h][1])

  if size(0) > target:
    raise RulerError(f"{what} needs {size(0) + 1} tokens with its smallest haystack (the "
                     "end-of-document token included); give --lengths of at least that")
  probe = min(most, 8)
  slope = max((size(probe) - size(0)) / probe, 1e-3) if probe else 1.0
  guess = int(min(most, max(0, (target - size(0)) / slope)))
  step = max(1, int(target * TOLERANCE / slope / 2))
  if size(guess) <= target:
    lo, hi = guess, min(most, guess + step)
    while hi > lo and size(hi) <= target:
      lo, hi, step = hi, min(most, hi + step), step * 2
    if size(hi) <= target:
      lo = hi
  else:
    lo, hi = max(0, guess - step), guess
    while size(lo) > target:
      lo, hi, step = max(0, lo - step), lo, step * 2
  while hi - lo > 1:  # size(lo) <= target < size(hi)
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if size(mid) <= target else (lo, mid)
  best = max((h for h in seen if size(h) <= target), key=lambda h: (size(h), -h))
  return best, seen[best][0], seen[best][1]


def check_length(tokens: int, target: int, what: str, filler: str) -> None:
  """A `RulerError` when a fitted prompt is more than TOLERANCE short of its target (`filler`:
  what ran out)."""
  if tokens < target * (1 - TOLERANCE) or tokens > target:
    raise RulerError(f"{what}: the prompt holds {tokens} tokens of the {target} asked (more than "
                     f"{TOLERANCE:.0%} short: {filler} ran out); give a shorter length")
