"""RULER's score (`long_context.ruler`): the share of the expected strings the answer holds.

RULER scores each of its synthetic tasks, multi-query included, with `string_match_all`: an
answer's score is the share of its expected strings found in it (case-insensitive substrings),
after its `postprocess` (spaces stripped, control characters made newlines); a cell's score is the
mean over its answers (RULER prints it x 100). `process_results` and `aggregate` are the same
score for lm-eval: the task files `--ruler_out_lm_eval` writes call them (`ruler_export`).
"""

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(answer: str) -> str:
  """The answer as RULER reads it: stripped, its control characters turned into newlines."""
  return _CONTROL.sub("\n", answer.strip()).strip()


def string_match_all(answer: str, expected) -> float:
  """The share of `expected` (strings) that occur in the answer, ignoring case (0 to 1)."""
  answer = postprocess(answer).lower()
  return sum(e.lower() in answer for e in expected) / len(expected)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
  """lm-eval's per-document metrics: the answer's score under its length's name, -1 (absent)
  under every other length the task holds (as lm-eval's own RULER tasks report lengths)."""
  metrics = {str(length): -1.0 for length in doc["lengths"]}
  metrics[str(doc["length"])] = string_match_all(results[0], doc["outputs"])
  return metrics


def aggregate(scores: list[float]) -> float:
  """The mean of a length's scores, the -1 of other lengths' documents left out (-1 if none)."""
  kept = [s for s in scores if s != -1]
  return sum(kept) / len(kept) if kept else -1.0
