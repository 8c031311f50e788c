"""Multi-query associative recall (MQAR) at controlled distances: `data.dataset='mqar:<options>'`.

`parse(dataset, seq_len)` -> `MqarTask` (every option has a default, so 'mqar:' runs; a bad
option is a one-line ConfigError); `check` / `validate` hold it against data.seq_len,
data.vocab_size and a Perceiver-AR model's num_latents; `load` -> `MqarCorpus`, the
`pipeline.Corpus` interface with no files: `train_iterator` yields {inputs, targets, weights},
`eval_batches` adds `distances` (`[B, S]`, the query's distance at each answer, -1 elsewhere).
Sequence i of a split is a pure function of (task, split, seed, i); the loss is on the answers
only, all in the last `latents` positions. `DistanceAccuracy` / `accuracy_by_distance`: accuracy
of argmax predictions per distance bin.
Details (layout, options and defaults, limits, distances, vocabulary, batches): docs/data.md, MQAR.
"""

import dataclasses
import difflib
import hashlib
import json
import math
import re
from typing import Any, Iterator

import numpy as np

from efficient_lm.data.config import DataError
from efficient_lm.validation import ConfigError, require_positive_int

PREFIX = 'mqar:'
PAD_ID, EOS_ID, QUERY_ID = 0, 1, 2
NUM_RESERVED = 3
SPLITS = ('train', 'validation', 'test')
TRAIN_SEQUENCES = 2**32  # the train split's nominal size: the iterator wraps after it (never in practice)
DEFAULT_SEQ_LEN = 1024
DEFAULT_BINS = 8
OPTIONS = ('seq_len', 'latents', 'queries', 'pairs', 'min_distance', 'max_distance', 'keys',
           'values', 'filler', 'eval_sequences', 'seed', 'pair_tokens')
DEFAULT_PAIR_TOKENS = 2  # `k v`; 1 = one token per pair. A spec names pair_tokens only when 1, so
                         # the tasks written before it keep their spec and their sequences.
_ATTEMPTS = 100  # layouts tried per sequence before giving up (a retry is rare: see _crowding)
_DRAWS = 16      # random candidate positions tried before enumerating all of them


# ----------------------------------------------------------------------------------------------
# The task and its options.


@dataclasses.dataclass(frozen=True)
class MqarTask:
  """One MQAR task: every option resolved (docs/data.md, MQAR)."""
  seq_len: int
  latents: int
  queries: int
  pairs: int
  min_distance: int
  max_distance: int
  keys: int
  values: int
  filler: int
  eval_sequences: int
  seed: int
  pair_tokens: int = DEFAULT_PAIR_TOKENS

  @property
  def key_start(self) -> int:
    return NUM_RESERVED

  @property
  def value_start(self) -> int:
    return NUM_RESERVED + self.keys

  @property
  def filler_start(self) -> int:
    return NUM_RESERVED + self.keys + self.values

  @property
  def pair_start(self) -> int:
    """The first pair token (pair_tokens=1): pair (k, v) is pair_start + k * values + v."""
    return NUM_RESERVED + self.keys + self.values + self.filler

  @property
  def vocab_size(self) -> int:
    joint = self.keys * self.values if self.pair_tokens == 1 else 0
    return NUM_RESERVED + self.keys + self.values + self.filler + joint

  @property
  def spec(self) -> str:
    """The canonical dataset string: every option spelled out (pair_tokens only when it is not
    the default); parse(spec) == self."""
    return PREFIX + ','.join(f'{name}={getattr(self, name)}' for name in OPTIONS
                             if name != 'pair_tokens' or self.pair_tokens != DEFAULT_PAIR_TOKENS)

  def num_sequences(self, split: str) -> int:
    if split not in SPLITS:
      raise ValueError(f'{self.spec} has no split {split!r}; it has {SPLITS}')
    return TRAIN_SEQUENCES if split == 'train' else self.eval_sequences


def _fail(name: str, value: Any, requirement: str, fix: str) -> None:
  raise ConfigError(f'mqar:{name}={value!r} {requirement}; {fix}')


def parse(dataset: str, seq_len: int | None = None) -> MqarTask:
  """The task named by `dataset` ('mqar:key=value,...'); `seq_len` (the run's data.seq_len) is
  the window when the options do not set one. Raises a one-line ConfigError for a bad option."""
  if not isinstance(dataset, str) or not dataset.startswith(PREFIX):
    raise ConfigError(f'data.dataset={dataset!r} is not an MQAR task; write mqar:<options>, e.g. '
                      "'mqar:pairs=64,queries=16' (or just 'mqar:' for the defaults)")
  if seq_len is not None:
    require_positive_int('data.seq_len', seq_len)
  given: dict[str, int] = {}
  for item in dataset[len(PREFIX):].split(','):
    item = item.strip()
    if not item:
      continue  # 'mqar:', a trailing comma
    name, sep, text = (part.strip() for part in item.partition('='))
    if name not in OPTIONS:
      close = difflib.get_close_matches(name, OPTIONS, n=3, cutoff=0.5)
      hint = f"did you mean {' or '.join(close)}? " if close else ''
      raise ConfigError(f'data.dataset={dataset!r} has an unknown mqar option {name!r}; {hint}'
                        f"the options are {', '.join(OPTIONS)}")
    if not sep or not text:
      _fail(name, text, 'has no value', f'write {name}=<integer>')
    if name in given:
      _fail(name, text, f'is given twice (also {name}={given[name]})', f'give {name} once')
    if not re.fullmatch(r'[+-]?[0-9]+', text):
      _fail(name, text, 'must be an integer', f'set {name} to a whole number')
    given[name] = int(text)

  def positive(name: str, value: int, least: int = 1) -> int:
    if value < least:
      _fail(name, value, f'must be at least {least}', f'set {name}>={least}')
    return value

  S = positive('seq_len', given.get('seq_len', seq_len or DEFAULT_SEQ_LEN), 8)
  Z = positive('latents', given.get('latents', min(256, S // 4)), 4)
  if Z > S - 5:
    _fail('latents', Z, f'leaves fewer than 5 positions before the queries in seq_len={S}',
          f'lower latents to at most {S - 5} (or raise seq_len)')
  Q = positive('queries', given.get('queries', max(1, Z // 16)))
  if 4 * Q > Z:  # placed at random, 3-position queries jam near 80% of the latents
    _fail('queries', Q, f'do not fit in latents={Z} (3 positions each, ? key value, at most 3/4 of '
          'the latents filled)', f'lower queries to at most {Z // 4} or raise latents')
  P = positive('pairs', given.get('pairs', 4 * Q))
  if P < Q:
    _fail('pairs', P, f'is below queries={Q} (each query asks for a different pair)',
          f'raise pairs to at least {Q} or lower queries')
  room = S - Z - 1  # cells x[1 .. S-Z-1] before the latents
  most_pairs = 3 * room // 8  # pairs (2 cells each) fill at most 3/4 of them: placed at random,
  if P > most_pairs:          # they cannot jam (random dimers jam near 86%)
    _fail('pairs', P, f'do not fit in the {room} positions before the latents (2 each, at most '
          '3/4 of them filled)', f'lower pairs to at most {most_pairs}, lower latents or raise seq_len')
  K = positive('keys', given.get('keys', 1024))
  if P > K:
    _fail('pairs', P, f'exceeds keys={K} (each key appears once per sequence)',
          f'lower pairs or raise keys to at least {P}')
  V = positive('values', given.get('values', 1024))
  F = positive('filler', given.get('filler', 1024), 0)
  longest = S - 3  # a pair at x[1], its query's value at x[S-1]
  D1 = positive('max_distance', given.get('max_distance', S - Z), 3)
  if D1 > longest:
    _fail('max_distance', D1, f'cannot fit in seq_len={S} (a pair and its query are at most '
          f'seq_len-3={longest} apart)', f'lower max_distance to at most {longest}')
  D0 = given.get('min_distance', 32)
  if D0 < 3:
    _fail('min_distance', D0, 'is below 3 (a pair sits before the latents, its query inside them)',
          'set min_distance>=3')
  if D0 > D1:
    _fail('min_distance', D0, f'exceeds max_distance={D1}',
          f'lower min_distance to at most {D1} or raise max_distance')
  short, long = _crowding(S, Z, Q, D0, D1)
  if short is not None:
    better = next((d for d in np.unique(np.geomspace(D0 + 1, D1, 64).astype(int))
                   if _crowding(S, Z, Q, int(d), D1)[0] is None), None)
    _fail('min_distance', D0, f'crowds the short distances: about {short[1]:.1f} of queries={Q} fall '
          f'below distance {short[0]}, more than a quarter of the {short[2]} positions there hold (3 each)',
          f'raise min_distance to {better}' if better else 'lower queries')
  if long is not None:
    _fail('max_distance', D1, f'crowds the long distances: about {long[1]:.1f} of queries={Q} fall '
          f'at distance {long[0]} or more, more than a quarter of the {long[2]} positions there '
          'hold (3 each)', 'lower max_distance or queries')
  pair_tokens = given.get('pair_tokens', DEFAULT_PAIR_TOKENS)
  if pair_tokens not in (1, 2):
    _fail('pair_tokens', pair_tokens, 'must be 1 or 2', "write pair_tokens=2 (a pair is 'k v', the "
          "default) or pair_tokens=1 (one token per pair)")
  N = positive('eval_sequences', given.get('eval_sequences', 512))
  seed = given.get('seed', 0)
  if not 0 <= seed < 2**32:
    _fail('seed', seed, 'must be in [0, 2**32)', 'set seed to a non-negative 32-bit integer')
  return MqarTask(seq_len=S, latents=Z, queries=Q, pairs=P, min_distance=D0, max_distance=D1,
                  keys=K, values=V, filler=F, eval_sequences=N, seed=seed, pair_tokens=pair_tokens)


def _crowding(S: int, Z: int, Q: int, D0: int, D1: int):
  """Where log-uniform distances would crowd the queries: (distance, expected queries, positions)
  at the short end and at the long end, each None when there is room.

  A query at distance d < D <= Z + 1 has its answer among the first D - 3 positions of the
  latents (and its pair among the last D - 3 before them); one at d >= D >= S - Z among the last
  S - 2 - D of the window. The expected number there may fill (3 positions each) at most a
  quarter of them: draws that do not fit are drawn again, and many retries would bend the
  distance distribution (at a quarter they are rare, a few percent of sequences, and the bend
  is within sampling noise). In between, only the latents bound the queries (4 * queries <= Z)."""
  L = math.log((D1 + 1) / D0)
  worst = []
  for D_N, expected_N, positions_N in (
      (np.arange(D0 + 1, min(D1, Z) + 2), lambda D: Q * np.log(D / D0) / L, lambda D: D - 3),
      (np.arange(max(D0, S - Z), D1 + 1), lambda D: Q * np.log((D1 + 1) / D) / L,
       lambda D: S - 2 - D)):
    if not len(D_N):
      worst.append(None)
      continue
    excess_N = expected_N(D_N) - positions_N(D_N) / 12
    i = int(np.argmax(excess_N))
    worst.append((int(D_N[i]), float(expected_N(D_N[i])), int(positions_N(D_N[i])))
                 if excess_N[i] > 0 else None)
  return tuple(worst)


def check(task: MqarTask, seq_len: int, *, vocab_size: int | None = None,
          num_latents: int | None = None) -> None:
  """The run's data.seq_len (and data.vocab_size, and a Perceiver-AR model's num_latents, when
  given) against the task: one-line ConfigError when the model could not be trained on it."""
  if seq_len != task.seq_len:
    raise ConfigError(f'data.seq_len={seq_len!r} differs from the mqar window seq_len='
                      f'{task.seq_len}; set data.seq_len={task.seq_len} (or leave seq_len out of '
                      'data.dataset to take data.seq_len)')
  if vocab_size is not None and vocab_size < task.vocab_size:
    pairs = ' + keys x values pair tokens' if task.pair_tokens == 1 else ''
    raise ConfigError(f'data.vocab_size={vocab_size!r} is below the mqar vocabulary '
                      f'(3 reserved + keys + values + filler{pairs} = {task.vocab_size}); set '
                      f'data.vocab_size={task.vocab_size} (a larger one is lowered to it)')
  if num_latents is not None and num_latents < task.latents:
    raise ConfigError(f'model.num_latents={num_latents!r} is below mqar:latents={task.latents}: '
                      'the model would not predict every answer; set model.num_latents='
                      f'{task.latents} (or lower latents in data.dataset)')


# ----------------------------------------------------------------------------------------------
# Sequences.


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


# ----------------------------------------------------------------------------------------------
# The corpus, its iterator and its tokenizer.


class MqarTokenizer:
  """Ids <-> words: '<pad>', '<eos>', '?', 'k<i>', 'v<i>', 'f<i>' (i counts from 0 within its
  range), 'k<i>=v<j>' for a pair token (pair_tokens=1); decode of an id outside the vocabulary
  gives '<id:N>'. No sentencepiece model
  (model_path None): `save` writes the task instead (JSON: kind, dataset, vocab_size), which
  `load` reads back, so a workdir records which task it was trained on."""

  model_path = None

  def __init__(self, task: MqarTask):
    self.task = task

  @property
  def vocab_size(self) -> int:
    return self.task.vocab_size

  @property
  def eos_id(self) -> int:
    return EOS_ID

  @property
  def pad_id(self) -> int:
    return PAD_ID

  def _ranges(self):
    t = self.task
    return (('k', t.key_start, t.keys), ('v', t.value_start, t.values), ('f', t.filler_start, t.filler))

  def _word(self, i: int) -> str:
    if i in (PAD_ID, EOS_ID, QUERY_ID):
      return ('<pad>', '<eos>', '?')[i]
    for letter, start, size in self._ranges():
      if start <= i < start + size:
        return f'{letter}{i - start}'
    t = self.task
    if t.pair_tokens == 1 and t.pair_start <= i < t.vocab_size:
      return f'k{(i - t.pair_start) // t.values}=v{(i - t.pair_start) % t.values}'
    return f'<id:{i}>'

  def decode(self, ids) -> str:
    return ' '.join(self._word(int(i)) for i in np.asarray(ids).reshape(-1))

  def encode(self, text: str) -> np.ndarray:
    """int32 ids of a space-separated string of decode's words (no eos added)."""
    fixed = {'<pad>': PAD_ID, '<eos>': EOS_ID, '?': QUERY_ID}
    ids = []
    for word in text.split():
      if word in fixed:
        ids.append(fixed[word])
        continue
      pair = re.fullmatch(r'k([0-9]+)=v([0-9]+)', word)
      t = self.task
      if pair and t.pair_tokens == 1 and int(pair[1]) < t.keys and int(pair[2]) < t.values:
        ids.append(t.pair_start + int(pair[1]) * t.values + int(pair[2]))
        continue
      for letter, start, size in self._ranges():
        if word[:1] == letter and word[1:].isdigit() and int(word[1:]) < size:
          ids.append(start + int(word[1:]))
          break
      else:
        raise ValueError(f'{word!r} is not an MQAR token of {self.task.spec}; write k<i> (i < '
                         f'{self.task.keys}), v<i> (i < {self.task.values}), f<i> (i < '
                         f'{self.task.filler}), ?, <eos> or <pad>'
                         + (', or k<i>=v<j> (a pair)' if self.task.pair_tokens == 1 else ''))
    return np.asarray(ids, np.int32)

  def encode_batch(self, texts) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  @property
  def identity(self) -> dict:
    return {'kind': 'mqar', 'dataset': self.task.spec, 'vocab_size': self.vocab_size}

  def save(self, path: str) -> None:
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(self.identity, f, indent=1)

  @classmethod
  def load(cls, path: str) -> 'MqarTokenizer':
    with open(path, encoding='utf-8') as f:
      record = json.load(f)
    if record.get('kind') != 'mqar':
      raise ValueError(f'{path} does not describe an MQAR task (kind={record.get("kind")!r})')
    return cls(parse(record['dataset']))

  def __repr__(self) -> str:
    return f'MqarTokenizer({self.task.spec!r}, vocab_size={self.vocab_size})'


class MqarIterator:
  """Batches of `split` in order, forever: global batch b holds sequences b*G .. b*G+G-1
  (G = batch_size * process_count), of which this process yields rows process_index*batch_size
  onwards. get_state() is JSON-able; set_state() resumes at the next unseen sequence (also
  with another batch size or process count)."""

  def __init__(self, task: MqarTask, batch_size: int, seed: int, split: str, process_index: int,
               process_count: int):
    self._task, self._batch_size, self._seed, self._split = task, batch_size, seed, split
    self._process_index, self._process_count = process_index, process_count
    self._next = 0  # sequences of the split consumed by all processes together

  def __iter__(self) -> 'MqarIterator':
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    n = self._task.num_sequences(self._split)
    first = self._next + self._process_index * self._batch_size
    rows = [(first + j) % n for j in range(self._batch_size)]
    self._next += self._batch_size * self._process_count
    out = batch(self._task, self._split, rows, self._seed)
    del out['distances']  # the compiled train step takes inputs, targets, weights
    return out

  def _identity(self) -> dict:
    return {'dataset': self._task.spec, 'split': self._split, 'seed': self._seed}

  def get_state(self) -> dict:
    return {**self._identity(), 'next_sequence': self._next}

  def set_state(self, state: dict) -> None:
    mine = self._identity()
    theirs = {k: state.get(k) for k in mine}
    if theirs != mine:
      raise ValueError(f'the saved data position is for {theirs}, this iterator draws {mine}; '
                       'resume with the data.dataset and train.seed the run was started with')
    self._next = int(state['next_sequence'])


def _require_int(name: str, value: Any, least: int) -> None:
  if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= least):
    raise ConfigError(f'{name}={value!r} must be an integer >= {least}; pass an integer >= {least}')


class MqarCorpus:
  """The `pipeline.Corpus` interface over generated MQAR sequences (docs/data.md, MQAR)."""

  def __init__(self, task: MqarTask, *, batch_size: int = 8):
    self.task = task
    self.name = task.spec
    self.tokenizer = MqarTokenizer(task)
    # What a workdir records (`workdir.py`): the task is all there is to the data.
    self.identity = {'dataset': task.spec, 'source': 'generated', 'vocab_size': task.vocab_size,
                     'tokenizer_sha256': hashlib.sha256(task.spec.encode()).hexdigest()}
    self.seq_len = task.seq_len
    self.batch_size = batch_size
    self.splits = SPLITS

  def _check(self, split: str, seq_len: int | None) -> None:
    self.task.num_sequences(split)  # raises for an unknown split
    if seq_len not in (None, self.task.seq_len):
      raise ConfigError(f'seq_len={seq_len!r} differs from the mqar window seq_len='
                        f'{self.task.seq_len}; MQAR windows are fixed: use {self.task.seq_len}')

  def num_documents(self, split: str) -> int:
    """Sequences in the split (train: TRAIN_SEQUENCES, a nominal size)."""
    return self.task.num_sequences(split)

  def num_tokens(self, split: str) -> int:
    """Targets in the split: seq_len per sequence (the answers among them: num_bytes)."""
    return self.num_documents(split) * self.task.seq_len

  def num_bytes(self, split: str) -> int:
    """MQAR has no text: the number of answers (queries x sequences), so bits per byte is bits
    per answer (every scored target is an answer)."""
    return self.num_documents(split) * self.task.queries

  def num_windows(self, split: str, *, drop_remainder: bool = False, seq_len: int | None = None) -> int:
    del drop_remainder  # one window per sequence, never partial
    self._check(split, seq_len)
    return self.num_documents(split)

  def tokens(self, split: str) -> np.ndarray:
    """validation / test as one packed stream [eos, body_0, eos, body_1, ..., eos]: window w is
    stream[w*S : w*S + S + 1], sequence w exactly. Its weights are not all 1: score MQAR with
    eval_batches, which has them."""
    if split == 'train':
      raise ValueError(f'{self.name}: the train split is generated batch by batch and has no '
                       'stream; use train_iterator, or tokens() of validation or test')
    S, n = self.task.seq_len, self.num_documents(split)
    stream = np.empty(n * S + 1, np.int32)
    for i in range(n):
      stream[i * S:(i + 1) * S + 1] = sequence(self.task, split, i)[0]
    return stream

  def train_iterator(self, batch_size: int | None = None, seed: int = 0, *, split: str = 'train',
                     seq_len: int | None = None, process_index: int = 0,
                     process_count: int = 1) -> MqarIterator:
    """Endless batches of `split` (train: fresh sequences; validation / test: cycled)."""
    batch_size = batch_size or self.batch_size
    self._check(split, seq_len)
    _require_int('batch_size', batch_size, 1)
    _require_int('seed', seed, 0)
    _require_int('process_count', process_count, 1)
    if not 0 <= process_index < process_count:
      raise ConfigError(f'process_index={process_index!r} must be in [0, process_count='
                        f'{process_count}); pass jax.process_index() and jax.process_count()')
    return MqarIterator(self.task, batch_size, int(seed), split, process_index, process_count)

  def eval_batches(self, split: str, batch_size: int | None = None, *, seq_len: int | None = None,
                   process_index: int = 0, process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """Every sequence of `split` once, in order, as {inputs, targets, weights, distances}; the
    last global batch is padded with rows of weight 0. Each process gets its rows of every
    global batch (all yield the same number of batches)."""
    batch_size = batch_size or self.batch_size
    self._check(split, seq_len)
    n = self.num_documents(split)
    global_batch = batch_size * process_count
    for first in range(0, n, global_batch):
      start = first + process_index * batch_size
      yield batch(self.task, split, [i if i < n else None for i in range(start, start + batch_size)])

  def __repr__(self) -> str:
    return (f'MqarCorpus({self.name}, vocab={self.task.vocab_size}, '
            f'eval sequences={self.task.eval_sequences})')


def validate(data_config) -> MqarTask:
  """The task of `config.data` (dataset 'mqar:...'), checked against data.seq_len and
  data.vocab_size; cheap (nothing is generated)."""
  task = parse(data_config['dataset'], seq_len=data_config['seq_len'])
  check(task, data_config['seq_len'], vocab_size=data_config['vocab_size'])
  return task


def load(data_config) -> MqarCorpus:
  """`data.load` for an 'mqar:' dataset: validates and returns the corpus (nothing to prepare)."""
  return MqarCorpus(validate(data_config), batch_size=data_config['batch_size'])


# ----------------------------------------------------------------------------------------------
# Scoring by distance.


def distance_bins(task: MqarTask, num_bins: int = DEFAULT_BINS) -> np.ndarray:
  """`num_bins + 1` log-spaced edges from min_distance to max_distance + 1: bin k holds the
  distances d with edges[k] <= d < edges[k+1] (each bin an equal share of log D, of which the
  distance is the floor)."""
  _require_int('num_bins', num_bins, 1)
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
