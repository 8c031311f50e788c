"""The MQAR task: `parse` an 'mqar:<options>' string into an `MqarTask`, `check` / `validate` it.

The options are `MqarTask`'s fields, parsed by the sources' one parser (`source_options`). Every
option has a default, so 'mqar:' runs; a bad option is a one-line ConfigError. `check`
holds a task against data.seq_len, data.vocab_size and a Perceiver-AR model's num_latents.
Details (options and defaults, limits, vocabulary): docs/data.md, MQAR.
"""

import dataclasses
import math
from typing import Any

import numpy as np

from efficient_lm.config.errors import ConfigError, require_positive_int
from efficient_lm.data import source_options

PREFIX = 'mqar:'
PAD_ID, EOS_ID, QUERY_ID = 0, 1, 2
NUM_RESERVED = 3
SPLITS = ('train', 'validation', 'test')
TRAIN_SEQUENCES = 2**32  # the train split's nominal size: the iterator wraps after it (never in practice)
DEFAULT_SEQ_LEN = 1024
DEFAULT_PAIR_TOKENS = 2  # `k v`; 1 = one token per pair. A spec names pair_tokens only when 1, so
                         # the tasks written before it keep their spec and their sequences.


def _fail(name: str, value: Any, requirement: str, fix: str) -> None:
  source_options.fail(PREFIX, name, value, requirement, fix)


def _check_latents(Z: int, o: dict) -> None:
  if Z > o['seq_len'] - 5:
    _fail('latents', Z, f"leaves fewer than 5 positions before the queries in seq_len={o['seq_len']}",
          f"lower latents to at most {o['seq_len'] - 5} (or raise seq_len)")


def _check_queries(Q: int, o: dict) -> None:
  if 4 * Q > o['latents']:  # placed at random, 3-position queries jam near 80% of the latents
    _fail('queries', Q, f"do not fit in latents={o['latents']} (3 positions each, ? key value, at "
          'most 3/4 of the latents filled)', f"lower queries to at most {o['latents'] // 4} or "
          'raise latents')


def _check_pairs(P: int, o: dict) -> None:
  Q = o['queries']
  if P < Q:
    _fail('pairs', P, f'is below queries={Q} (each query asks for a different pair)',
          f'raise pairs to at least {Q} or lower queries')
  room = o['seq_len'] - o['latents'] - 1  # cells x[1 .. S-Z-1] before the latents
  most_pairs = 3 * room // 8  # pairs (2 cells each) fill at most 3/4 of them: placed at random,
  if P > most_pairs:          # they cannot jam (random dimers jam near 86%)
    _fail('pairs', P, f'do not fit in the {room} positions before the latents (2 each, at most '
          '3/4 of them filled)', f'lower pairs to at most {most_pairs}, lower latents or raise seq_len')


def _check_min_distance(D0: int, o: dict) -> None:
  del o
  if D0 < 3:
    _fail('min_distance', D0, 'is below 3 (a pair sits before the latents, its query inside them)',
          'set min_distance>=3')


def _check_max_distance(D1: int, o: dict) -> None:
  S, Z, Q, D0 = o['seq_len'], o['latents'], o['queries'], o['min_distance']
  longest = S - 3  # a pair at x[1], its query's value at x[S-1]
  if D1 > longest:
    _fail('max_distance', D1, f'cannot fit in seq_len={S} (a pair and its query are at most '
          f'seq_len-3={longest} apart)', f'lower max_distance to at most {longest}')
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


def _check_keys(K: int, o: dict) -> None:
  if o['pairs'] > K:
    _fail('pairs', o['pairs'], f'exceeds keys={K} (each key appears once per sequence)',
          f"lower pairs or raise keys to at least {o['pairs']}")


def _check_seed(seed: int, o: dict) -> None:
  del o
  if not 0 <= seed < 2**32:
    _fail('seed', seed, 'must be in [0, 2**32)', 'set seed to a non-negative 32-bit integer')


def _check_pair_tokens(pair_tokens: int, o: dict) -> None:
  del o
  if pair_tokens not in (1, 2):
    _fail('pair_tokens', pair_tokens, 'must be 1 or 2', "write pair_tokens=2 (a pair is 'k v', the "
          "default) or pair_tokens=1 (one token per pair)")


def _run_seq_len(run: dict) -> int:
  """The window when the options set none: the run's data.seq_len (checked), else the default."""
  if run.get('seq_len') is None:
    return DEFAULT_SEQ_LEN
  require_positive_int('data.seq_len', run['seq_len'])
  return run['seq_len']


option = source_options.option


@dataclasses.dataclass(frozen=True, kw_only=True)
class MqarTask:
  """One MQAR task: every option resolved (docs/data.md, MQAR). The fields are the options of
  'mqar:key=value,...', declared with their defaults and checks (`source_options`), in the order
  of the canonical spec; each check reads the options before it."""
  seq_len: int = option(derive=lambda o, run: _run_seq_len(run), least=8,
                        doc="the window (default: the run's data.seq_len)")
  latents: int = option(derive=lambda o, run: min(256, o['seq_len'] // 4), least=4,
                        check=_check_latents, doc='the last positions, where the queries are')
  queries: int = option(derive=lambda o, run: max(1, o['latents'] // 16), least=1,
                        check=_check_queries, doc='queries per sequence')
  pairs: int = option(derive=lambda o, run: 4 * o['queries'], least=1, check=_check_pairs,
                      doc='key-value pairs per sequence')
  min_distance: int = option(32, check=_check_min_distance,
                             doc='the shortest distance from a pair to its query')
  max_distance: int = option(derive=lambda o, run: o['seq_len'] - o['latents'], least=3,
                             check=_check_max_distance,
                             doc='the longest distance (distances log-uniform between)')
  keys: int = option(1024, least=1, check=_check_keys, doc='key tokens')
  values: int = option(1024, least=1, doc='value tokens')
  filler: int = option(1024, least=0, doc='filler tokens between the pairs')
  eval_sequences: int = option(512, least=1, doc='sequences of each held-out split')
  seed: int = option(0, check=_check_seed, doc='the held-out sequences\' seed')
  pair_tokens: int = option(DEFAULT_PAIR_TOKENS, check=_check_pair_tokens, in_spec=False,
                            doc="2: a pair is 'k v'; 1: one token per pair")

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
    return source_options.spec(self, PREFIX)

  def num_sequences(self, split: str) -> int:
    if split not in SPLITS:
      raise ValueError(f'{self.spec} has no split {split!r}; it has {SPLITS}')
    return TRAIN_SEQUENCES if split == 'train' else self.eval_sequences


OPTIONS = source_options.names(MqarTask)


def parse(dataset: str, seq_len: int | None = None) -> MqarTask:
  """The task named by `dataset` ('mqar:key=value,...'); `seq_len` (the run's data.seq_len) is
  the window when the options do not set one. Raises a one-line ConfigError for a bad option."""
  return source_options.parse(MqarTask, PREFIX, dataset, what='an MQAR task',
                              example='mqar:pairs=64,queries=16', run={'seq_len': seq_len})


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
