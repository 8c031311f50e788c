"""The MQAR task: `parse` an 'mqar:<options>' string into an `MqarTask`, `check` / `validate` it.

Every option has a default, so 'mqar:' runs; a bad option is a one-line ConfigError. `check`
holds a task against data.seq_len, data.vocab_size and a Perceiver-AR model's num_latents.
Details (options and defaults, limits, vocabulary): docs/data.md, MQAR.
"""

import dataclasses
import difflib
import math
import re
from typing import Any

import numpy as np

from efficient_lm.config.errors import ConfigError, require_positive_int

PREFIX = 'mqar:'
PAD_ID, EOS_ID, QUERY_ID = 0, 1, 2
NUM_RESERVED = 3
SPLITS = ('train', 'validation', 'test')
TRAIN_SEQUENCES = 2**32  # the train split's nominal size: the iterator wraps after it (never in practice)
DEFAULT_SEQ_LEN = 1024
OPTIONS = ('seq_len', 'latents', 'queries', 'pairs', 'min_distance', 'max_distance', 'keys',
           'values', 'filler', 'eval_sequences', 'seed', 'pair_tokens')
DEFAULT_PAIR_TOKENS = 2  # `k v`; 1 = one token per pair. A spec names pair_tokens only when 1, so
                         # the tasks written before it keep their spec and their sequences.


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


def require_int(name: str, value: Any, least: int) -> None:
  if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= least):
    raise ConfigError(f'{name}={value!r} must be an integer >= {least}; pass an integer >= {least}')


def validate(data_config) -> MqarTask:
  """The task of the typed data section (dataset 'mqar:...'), checked against data.seq_len and
  data.vocab_size; cheap (nothing is generated)."""
  task = parse(data_config.dataset, seq_len=data_config.seq_len)
  check(task, data_config.seq_len, vocab_size=data_config.vocab_size)
  return task
