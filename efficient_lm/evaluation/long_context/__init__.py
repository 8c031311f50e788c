"""The field's long-context evaluations of a trained model (docs/long_context_evals.md).

- `needle`, `needle_grid`: needle in a haystack (RULER's NIAH variants) over a grid of lengths and
  depths, greedy exact match and the answer's rank among distractors; needle.json, needle.png.
- `extrapolate`: loss by position at 1x, 2x, 4x, 8x the trained length.
- `ruler`, `ruler_fit`, `ruler_grid`, `ruler_score`, `ruler_export`: RULER's eleven synthetic
  tasks drawn on the model's own tokenizer, fitted to lengths in its tokens, answered greedily,
  scored as RULER scores them; ruler.json, ruler.png, lm-eval task files of the same prompts.
- `reach`: how long an input each family can take (the one place the rules live).

The command line, `python -m efficient_lm.evaluate --task=needle | extrapolate | ruler`, is
`efficient_lm/cli/long_context_command.py` (with `cli/ruler_command.py`).
"""
