"""The field's long-context evaluations of a trained model (docs/long_context_evals.md).

- `needle`, `needle_grid`: needle in a haystack (RULER's NIAH variants) over a grid of lengths and
  depths, greedy exact match and the answer's rank among distractors; needle.json, needle.png.
- `extrapolate`: loss by position at 1x, 2x, 4x, 8x the trained length.
- `reach`: how long an input each family can take (the one place the rules live).
- `command`: `python -m efficient_lm.evaluate --task=needle | extrapolate`.
"""
