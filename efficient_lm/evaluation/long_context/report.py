"""What the long-context evaluations share: intervals, chance levels, the figures' files."""

import math
import os

import numpy as np

from efficient_lm.runtime import figures

Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval


def wilson(successes: int, n: int) -> dict:
  """A proportion with its 95% Wilson score interval (None figures for n = 0)."""
  if n == 0:
    return {"count": 0, "n": 0, "share": None, "ci_low": None, "ci_high": None}
  p = successes / n
  centre = (p + Z95 ** 2 / (2 * n)) / (1 + Z95 ** 2 / n)
  half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / (1 + Z95 ** 2 / n)
  return {"count": int(successes), "n": int(n), "share": p,
          "ci_low": 0.0 if successes == 0 else max(0.0, centre - half),
          "ci_high": 1.0 if successes == n else min(1.0, centre + half)}


def mean_interval(values) -> dict:
  """A mean with its 95% normal interval (mean +- 1.96 standard errors)."""
  values = np.asarray(values, np.float64)
  if not len(values):
    return {"n": 0, "mean": None, "ci_low": None, "ci_high": None}
  mean = float(values.mean())
  half = Z95 * float(values.std(ddof=1)) / math.sqrt(len(values)) if len(values) > 1 else math.inf
  return {"n": int(len(values)), "mean": mean, "ci_low": mean - half, "ci_high": mean + half}


def chance(num_true: int, num_distractors: int) -> dict:
  """What random scores give: the top-1 share and the mean reciprocal rank of the best of
  `num_true` right answers among `num_distractors` wrong ones (rank = 1 + wrong ones above it)."""
  total = num_true + num_distractors
  mrr, none_yet = 0.0, 1.0  # none_yet: P(the first k drawn are all wrong)
  for k in range(num_distractors + 1):
    mrr += none_yet * num_true / (total - k) / (k + 1)
    none_yet *= (num_distractors - k) / (total - k)
  return {"top1": num_true / total, "mrr": mrr}


def write_json(record: dict, path: str) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    figures.dump(record, f, indent=1)


def pyplot():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt
