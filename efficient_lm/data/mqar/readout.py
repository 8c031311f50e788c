"""MQAR scoring by distance: `DistanceAccuracy` / `accuracy_by_distance`, the accuracy of argmax
predictions per log-spaced distance bin (`distance_bins`), with binomial standard errors.
"""

import numpy as np

from efficient_lm.data.mqar.task import MqarTask, require_int

DEFAULT_BINS = 8


def distance_bins(task: MqarTask, num_bins: int = DEFAULT_BINS) -> np.ndarray:
  """`num_bins + 1` log-spaced edges from min_distance to max_distance + 1: bin k holds the
  distances d with edges[k] <= d < edges[k+1] (each bin an equal share of log D, of which the
  distance is the floor)."""
  require_int('num_bins', num_bins, 1)
  edges = np.geomspace(task.min_distance, task.max_distance + 1, num_bins + 1)
  whole = np.round(edges)
  return np.where(np.abs(edges - whole) < 1e-9 * edges, whole, edges)  # 32, not 31.999999


def _binomial_stderr(correct: np.ndarray, count: np.ndarray) -> np.ndarray:
  p = correct / np.maximum(count, 1)
  return np.sqrt(p * (1 - p) / np.maximum(count, 1))


class DistanceAccuracy:
  """Answer accuracy per distance bin, accumulated over eval batches.

      score = DistanceAccuracy(task)
      for b in corpus.eval_batches('validation'):
        score.add(b['distances'], b['targets'], predictions)  # argmax ids, or the logits
      score.result()
  """

  def __init__(self, task: MqarTask, num_bins: int = DEFAULT_BINS):
    self.task = task
    self.edges = distance_bins(task, num_bins)
    self.correct = np.zeros(num_bins, np.int64)
    self.count = np.zeros(num_bins, np.int64)

  def add(self, distances_BT, targets_BT, predicted) -> None:
    """`predicted`: int ids `[B, T']` or logits `[B, T', V]` of the last T' <= T positions (T' < T
    for Perceiver-AR); every answer must fall on one of them."""
    distances_BT, targets_BT = np.asarray(distances_BT), np.asarray(targets_BT)
    predicted = np.asarray(predicted)
    if predicted.ndim == targets_BT.ndim + 1:
      predicted = predicted.argmax(axis=-1)
    B, T = targets_BT.shape
    covered = predicted.shape[1] if predicted.ndim == 2 else -1
    if predicted.shape[0] != B or not 0 < covered <= T:
      raise ValueError(f'predictions of shape {predicted.shape} do not match targets {targets_BT.shape}; '
                       'pass [B, T\'] ids or [B, T\', V] logits of the last T\' positions')
    answer_BT = distances_BT >= 0
    if answer_BT[:, :T - covered].any():
      raise ValueError(f'answers lie before the last {covered} positions the predictions cover; '
                       f'the model must predict at least the last mqar:latents={self.task.latents}')
    answer_BT = answer_BT[:, T - covered:]
    d_N = distances_BT[:, T - covered:][answer_BT]
    ok_N = (predicted == targets_BT[:, T - covered:])[answer_BT]
    bin_N = np.searchsorted(self.edges, d_N, side='right') - 1
    if ((bin_N < 0) | (bin_N >= len(self.count))).any():
      raise ValueError(f'distances {sorted(set(d_N[(bin_N < 0) | (bin_N >= len(self.count))]))[:5]} '
                       f'lie outside [{self.task.min_distance}, {self.task.max_distance}]')
    np.add.at(self.count, bin_N, 1)
    np.add.at(self.correct, bin_N, ok_N.astype(np.int64))

  def result(self) -> dict:
    """JSON-able: edges, per bin accuracy (None when empty), stderr = sqrt(p(1-p)/n), count and
    correct; and over all answers accuracy, stderr and count."""
    stderr = _binomial_stderr(self.correct, self.count)
    total, right = int(self.count.sum()), int(self.correct.sum())
    return {
        'edges': [float(e) for e in self.edges],
        'accuracy': [float(c / n) if n else None for c, n in zip(self.correct, self.count)],
        'stderr': [float(s) if n else None for s, n in zip(stderr, self.count)],
        'count': [int(n) for n in self.count],
        'correct': [int(c) for c in self.correct],
        'accuracy_all': right / total if total else None,
        'stderr_all': float(_binomial_stderr(np.array(right), np.array(total))) if total else None,
        'count_all': total,
    }


def accuracy_by_distance(task: MqarTask, distances_BT, targets_BT, predicted,
                         num_bins: int = DEFAULT_BINS) -> dict:
  """DistanceAccuracy over one batch (or arrays of any number of rows)."""
  score = DistanceAccuracy(task, num_bins)
  score.add(distances_BT, targets_BT, predicted)
  return score.result()
