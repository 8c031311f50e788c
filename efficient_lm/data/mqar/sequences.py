"""MQAR sequences: `sequence(task, split, index, seed)` and `batch` of them.

Sequence i of a split is a pure function of (task, split, seed, i); the loss is on the answers
only, all in the last `latents` positions. Layout and distances: docs/data.md, MQAR.
"""

import dataclasses
import hashlib
import json
import math

import numpy as np

from efficient_lm.data.errors import DataError
from efficient_lm.data.mqar.task import (DEFAULT_PAIR_TOKENS, EOS_ID, PAD_ID, QUERY_ID,
                                         MqarTask)

_ATTEMPTS = 100  # layouts tried per sequence before giving up (a retry is rare: see task._crowding)
_DRAWS = 16      # random candidate positions tried before enumerating all of them


def _split_key(task: MqarTask, split: str, seed: int) -> list[int]:
  """Four 32-bit words naming (task, split, seed): the entropy every sequence of the split
  starts from. Held-out splits ignore `seed` (the same for every training seed), and
  eval_sequences is left out (more eval sequences extend the set), and so is pair_tokens (the
  one-token form writes the same layouts)."""
  if split != 'train':
    seed = 0
  content = dataclasses.replace(task, eval_sequences=0, pair_tokens=DEFAULT_PAIR_TOKENS).spec
  digest = hashlib.sha256(json.dumps([content, split, int(seed)]).encode()).digest()
  return [int.from_bytes(digest[i:i + 4], 'little') for i in range(0, 16, 4)]


def _feasible(task: MqarTask, d_Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """[lo, hi]: the answer positions q a query at distance d may take (pair at q - d)."""
  S, Z = task.seq_len, task.latents
  # The query's cells x[q-1 .. q+1] lie in x[S-Z .. S-1]; its pair's x[p, p+1] in x[1 .. S-Z-1].
  return np.maximum(S - Z + 1, d_Q + 1), np.minimum(S - 2, S - Z - 2 + d_Q)


def _choose(rng: np.random.Generator, lo: int, hi: int, free_C: np.ndarray,
            offsets: np.ndarray) -> int | None:
  """A uniform choice among s in [lo, hi] whose cells s + offsets are all free; None if none is.

  Tries a few uniform draws first (the first free one is uniform among the free), then all."""
  s_N = rng.integers(lo, hi + 1, size=_DRAWS)
  ok_N = free_C[s_N[:, None] + offsets[None, :]].all(axis=1)
  if ok_N.any():
    return int(s_N[np.argmax(ok_N)])
  s_N = np.arange(lo, hi + 1)
  ok_N = free_C[s_N[:, None] + offsets[None, :]].all(axis=1)
  return int(rng.choice(s_N[ok_N])) if ok_N.any() else None


def _place_queries(task: MqarTask, rng: np.random.Generator, d_Q: np.ndarray, free_C: np.ndarray):
  """(answer positions q_Q, their pairs' positions q_Q - d_Q), marking their cells in `free_C`;
  None when the draw left a query no free position (the caller then draws the distances again:
  rare, as the most constrained queries, those with the fewest possible positions, go first)."""
  lo_Q, hi_Q = _feasible(task, d_Q)
  q_Q = np.zeros(task.queries, np.int64)
  for j in np.argsort(hi_Q - lo_Q, kind='stable'):
    d = int(d_Q[j])
    q = _choose(rng, int(lo_Q[j]), int(hi_Q[j]), free_C, np.array([-1, 0, 1, -d, 1 - d]))
    if q is None:
      return None
    free_C[[q - 1, q, q + 1, q - d, q + 1 - d]] = False
    q_Q[j] = q
  return q_Q, q_Q - d_Q


def _place_distractors(task: MqarTask, rng: np.random.Generator, free_C: np.ndarray):
  """Positions of the pairs - queries unqueried pairs, anywhere free before the latents: one
  after another, each uniform among the free places (the first free one of uniform draws);
  None if they jammed."""
  lo, hi = 1, task.seq_len - task.latents - 2
  free = free_C.tolist()  # Python lists: this loop runs for every distractor of every sequence
  p_M: list[int] = []
  missing = task.pairs - task.queries
  while len(p_M) < missing:
    before = len(p_M)
    for p in rng.integers(lo, hi + 1, size=2 * (missing - len(p_M)) + 8).tolist():
      if free[p] and free[p + 1]:
        free[p] = free[p + 1] = False
        p_M.append(p)
        if len(p_M) == missing:
          break
    if len(p_M) == before:  # nearly jammed: choose among all free places, if any is left
      p = _choose(rng, lo, hi, np.array(free), np.array([0, 1]))
      if p is None:
        return None
      free[p] = free[p + 1] = False
      p_M.append(p)
  return np.array(p_M, np.int64)


def _crowded(task: MqarTask, split: str, index: int, what: str) -> None:
  raise DataError(f'{task.spec}: no place for the {what} of {split} sequence {index} in '
                  f'{_ATTEMPTS} tries; they are too crowded: raise min_distance, latents or '
                  'seq_len, or lower queries or pairs')


def sequence(task: MqarTask, split: str, index: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(x int32 [S + 1], distances int32 [S]) of sequence `index` of `split`: inputs = x[:-1],
  targets = x[1:]; distances[q] = the query's distance at each answer position q, else -1.
  `seed` (the training seed) matters for `train` only."""
  S = task.seq_len
  if not 0 <= index < task.num_sequences(split):
    raise ValueError(f'{split} sequence {index} does not exist: {task.spec} has '
                     f'{task.num_sequences(split)} of them (0 onwards)')
  rng = np.random.default_rng([*_split_key(task, split, seed), int(index)])
  keys_P = task.key_start + rng.choice(task.keys, size=task.pairs, replace=False)
  values_P = task.value_start + rng.integers(task.values, size=task.pairs)
  free_C = np.ones(S + 1, bool)
  free_C[[0, S]] = False
  for _ in range(_ATTEMPTS):
    # floor of a log-uniform D on [min, max + 1): P(a <= d < b) = log(b / a) / log((max + 1) / min).
    log_D = rng.uniform(math.log(task.min_distance), math.log(task.max_distance + 1), task.queries)
    d_Q = np.clip(np.floor(np.exp(log_D)), task.min_distance, task.max_distance).astype(np.int64)
    after_queries_C = free_C.copy()
    queried = _place_queries(task, rng, d_Q, after_queries_C)
    if queried is not None:
      break
  else:
    _crowded(task, split, index, 'queries')
  for _ in range(_ATTEMPTS):  # only the distractors are drawn again: the distances stay as drawn
    free_C = after_queries_C.copy()
    distractors = _place_distractors(task, rng, free_C)
    if distractors is not None:
      break
  else:
    _crowded(task, split, index, 'pairs')
  q_Q = queried[0]
  p_P = np.concatenate([queried[1], distractors])
  x = (task.value_start + rng.integers(task.values + task.filler, size=S + 1)).astype(np.int32)
  x[0] = x[S] = EOS_ID
  if task.pair_tokens == 2:
    x[p_P], x[p_P + 1] = keys_P, values_P
  else:  # one token where the value would be (the key's cell keeps its filler): the same distances
    x[p_P + 1] = task.pair_start + (keys_P - task.key_start) * task.values + values_P - task.value_start
  Q = task.queries
  x[q_Q - 1], x[q_Q], x[q_Q + 1] = QUERY_ID, keys_P[:Q], values_P[:Q]
  distances_S = np.full(S, -1, np.int32)
  distances_S[q_Q] = d_Q
  return x, distances_S


def batch(task: MqarTask, split: str, indices, seed: int = 0) -> dict[str, np.ndarray]:
  """inputs, targets, weights (1 on answers) and distances `[B, S]` of sequences `indices`;
  an index of None gives a padding row (pad ids, weight 0, distance -1)."""
  S = task.seq_len
  x_BS1 = np.full((len(indices), S + 1), PAD_ID, np.int32)
  distances_BS = np.full((len(indices), S), -1, np.int32)
  for row, index in enumerate(indices):
    if index is not None:
      x_BS1[row], distances_BS[row] = sequence(task, split, index, seed)
  return {'inputs': x_BS1[:, :-1], 'targets': x_BS1[:, 1:],
          'weights': (distances_BS >= 0).astype(np.float32), 'distances': distances_BS}
