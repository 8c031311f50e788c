"""How a dataset without its own validation / test split gets them: the one rule for how many
documents are held out of train (`held_out_counts`), used by `text:` (files ranked by the sha256 of
their path) and `hf:` (rows ranked by a hash of their index)."""

HELD_OUT = ('validation', 'test')  # held out of train in this order


def held_out_counts(n: int, fractions: dict[str, float]) -> dict[str, int]:
  """Documents held out of `n` for each split in `fractions` ({split: fraction}): its rounded share,
  at least 1 when its fraction is above 0 (0 otherwise). Where the shares would leave train
  nothing, the largest is lowered (never below 1) until train keeps one; when even one each cannot
  leave train one (n <= the number of held-out splits), train is left without: the caller says so."""
  counts = {s: max(1, round(f * n)) if f > 0 else 0 for s, f in fractions.items()}
  while sum(counts.values()) > n - 1 and max(counts.values(), default=0) > 1:
    largest = max(counts, key=lambda s: (counts[s], s))
    counts[largest] -= 1
  return counts
