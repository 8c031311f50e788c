"""Tests of efficient_lm.data.mqar: options, layout, distances, determinism, sharding, scoring."""

import json
import math

import numpy as np
import pytest

from efficient_lm.config.data import DataConfig
from efficient_lm.config.errors import ConfigError
from efficient_lm.data import mqar

SMALL = ('mqar:seq_len=256,latents=64,queries=8,pairs=24,min_distance=16,max_distance=192,'
         'keys=64,values=16,filler=16,eval_sequences=24')


@pytest.fixture(scope='module')
def task():
  return mqar.parse(SMALL)


@pytest.fixture(scope='module')
def corpus(task):
  return mqar.MqarCorpus(task, batch_size=4)


@pytest.fixture(scope='module')
def validation(corpus):
  """All validation rows at once: inputs, targets, weights, distances `[24, S]`."""
  batches = list(corpus.eval_batches('validation', batch_size=8))
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def _windows(b):
  """The [B, S + 1] windows of a batch."""
  return np.concatenate([b['inputs'], b['targets'][:, -1:]], axis=1)


def _pair_lookup(task, inputs_S, targets_S):
  """{key: (position, value)} of the pairs: keys before the latents (the target after a key is
  its value)."""
  before = task.seq_len - task.latents
  return {int(inputs_S[p]): (p, int(targets_S[p])) for p in range(before)
          if task.key_start <= inputs_S[p] < task.value_start}


# ----------------------------------------------------------------------------------------------
# Options.


def test_defaults_and_canonical_spec():
  t = mqar.parse('mqar:')
  assert (t.seq_len, t.latents, t.queries, t.pairs, t.min_distance, t.max_distance) == (
      1024, 256, 16, 64, 32, 768)
  assert (t.keys, t.values, t.filler, t.eval_sequences, t.seed) == (1024, 1024, 1024, 512, 0)
  assert t.vocab_size == 3 + 3 * 1024
  assert mqar.parse(t.spec) == t
  assert mqar.parse('mqar:', seq_len=512).seq_len == 512  # the run's data.seq_len
  assert mqar.parse('mqar:seq_len=256', seq_len=512).seq_len == 256  # the option wins ...
  with pytest.raises(ConfigError, match='set data.seq_len=256'):  # ... and check refuses the run
    mqar.check(mqar.parse('mqar:seq_len=256', seq_len=512), 512)
  assert mqar.parse('mqar: pairs = 32 , queries=8,').pairs == 32  # spaces, a trailing comma
  user = mqar.parse('mqar:seq_len=4096,pairs=64,queries=16,min_distance=32,max_distance=4000,'
                    'latents=256,keys=1024,values=1024,filler=2048')
  assert user.vocab_size == 3 + 1024 + 1024 + 2048


@pytest.mark.parametrize('dataset, expected', [
    ('shakespeare', ['is not an MQAR task', 'mqar:<options>']),
    ('mqar:pairz=8', ["unknown mqar option 'pairz'", 'did you mean pairs', 'the options are']),
    ('mqar:pairs', ["mqar:pairs='' has no value", 'pairs=<integer>']),
    ('mqar:pairs=8.5', ["mqar:pairs='8.5' must be an integer"]),
    ('mqar:pairs=8,pairs=9', ['is given twice', 'give pairs once']),
    ('mqar:seq_len=0', ['mqar:seq_len=0 must be at least 8']),
    ('mqar:latents=1020', ['mqar:latents=1020 leaves fewer than 5', 'at most 1019']),
    ('mqar:queries=100', ['mqar:queries=100 do not fit in latents=256', 'at most 64']),
    ('mqar:queries=8,pairs=4', ['mqar:pairs=4 is below queries=8', 'raise pairs']),
    ('mqar:pairs=2000', ['mqar:pairs=2000 do not fit in the 767 positions', 'at most 287']),
    ('mqar:pairs=100,keys=64', ['mqar:pairs=100 exceeds keys=64', 'raise keys to at least 100']),
    ('mqar:filler=-1', ['mqar:filler=-1 must be at least 0']),
    ('mqar:max_distance=2000', ['mqar:max_distance=2000 cannot fit in seq_len=1024', 'at most 1021']),
    ('mqar:min_distance=2', ['mqar:min_distance=2 is below 3']),
    ('mqar:min_distance=500,max_distance=400', ['mqar:min_distance=500 exceeds max_distance=400']),
    ('mqar:min_distance=4', ['mqar:min_distance=4 crowds the short distances',
                             'raise min_distance to']),
    ('mqar:queries=64,min_distance=700,max_distance=1021', [
        'mqar:max_distance=1021 crowds the long distances', 'lower max_distance']),
    ('mqar:eval_sequences=0', ['mqar:eval_sequences=0 must be at least 1']),
    ('mqar:seed=-1', ['mqar:seed=-1 must be in [0, 2**32)']),
])
def test_bad_options(dataset, expected):
  with pytest.raises(ConfigError) as info:
    mqar.parse(dataset)
  message = str(info.value)
  assert '\n' not in message and '; ' in message, message  # one line: what is wrong; the fix
  for part in expected:
    assert part in message, message


def test_check_against_the_run(task):
  mqar.check(task, 256, vocab_size=99, num_latents=64)
  mqar.check(task, 256, vocab_size=8192)  # larger: the run lowers it to the task's (train.setup)
  for kwargs, expected in [(dict(seq_len=512), 'data.seq_len=512 differs'),
                           (dict(seq_len=256, vocab_size=98), 'set data.vocab_size=99'),
                           (dict(seq_len=256, num_latents=32), 'set model.num_latents=64')]:
    with pytest.raises(ConfigError, match=expected.replace('.', r'\.')):
      mqar.check(task, kwargs.pop('seq_len'), **kwargs)
  config = DataConfig(dataset=SMALL.replace('seq_len=256,', ''), seq_len=256, vocab_size=99,
                      batch_size=3)  # the typed data section
  loaded = mqar.load(config)
  assert loaded.task == task and loaded.batch_size == 3


# ----------------------------------------------------------------------------------------------
# Sequences.


def test_vocabulary_ranges(task, validation):
  t = task
  assert (t.key_start, t.value_start, t.filler_start, t.vocab_size) == (3, 67, 83, 99)
  assert len({mqar.PAD_ID, mqar.EOS_ID, mqar.QUERY_ID}) == 3 and t.key_start == mqar.NUM_RESERVED
  x = _windows(validation)
  assert x.min() >= mqar.EOS_ID and x.max() < t.vocab_size
  value_as_filler = filler_seen = 0
  for row in range(len(x)):
    inputs_S, targets_S = validation['inputs'][row], validation['targets'][row]
    pairs = _pair_lookup(t, inputs_S, targets_S)
    answers = np.flatnonzero(validation['distances'][row] >= 0)
    structural = {0, t.seq_len} | {p for p, _ in pairs.values()} | {p + 1 for p, _ in pairs.values()}
    structural |= {q + k for q in answers for k in (-1, 0, 1)}
    rest = np.array([x[row, i] for i in range(t.seq_len + 1) if i not in structural])
    assert ((rest >= t.value_start) & (rest < t.vocab_size)).all()  # filler: values or filler ids
    value_as_filler += int(((rest >= t.value_start) & (rest < t.filler_start)).sum())
    filler_seen += int((rest >= t.filler_start).sum())
  # Filler draws values and filler ids alike (16 each here): about half the filler is values.
  total = value_as_filler + filler_seen
  assert abs(value_as_filler - total / 2) < 4 * math.sqrt(total / 4)


def test_layout_and_weights(task, validation):
  S, Z = task.seq_len, task.latents
  x = _windows(validation)
  assert (x[:, 0] == mqar.EOS_ID).all() and (x[:, S] == mqar.EOS_ID).all()
  d_BS = validation['distances']
  np.testing.assert_array_equal(validation['weights'], (d_BS >= 0).astype(np.float32))
  assert validation['weights'].dtype == np.float32 and d_BS.dtype == np.int32
  for row in range(len(x)):
    inputs_S, targets_S = validation['inputs'][row], validation['targets'][row]
    answers = np.flatnonzero(d_BS[row] >= 0)
    assert len(answers) == task.queries
    assert answers.min() - 1 >= S - Z and answers.max() + 1 <= S - 1  # ? key value in the latents
    assert (inputs_S[answers - 1] == mqar.QUERY_ID).all()
    assert ((targets_S[answers] >= task.value_start) & (targets_S[answers] < task.filler_start)).all()
    is_key = (inputs_S >= task.key_start) & (inputs_S < task.value_start)
    pair_keys = np.flatnonzero(is_key[:S - Z])
    assert len(pair_keys) == task.pairs and pair_keys.max() + 1 < S - Z  # pairs end before them
    assert len(set(inputs_S[pair_keys])) == task.pairs  # each key once as a pair
    assert set(np.flatnonzero(is_key[S - Z:]) + S - Z) == set(answers)  # keys there: the queries
    assert (inputs_S == mqar.QUERY_ID).sum() == task.queries


def test_recorded_distances(task, validation):
  for row in range(len(validation['inputs'])):
    inputs_S, targets_S = validation['inputs'][row], validation['targets'][row]
    pairs = _pair_lookup(task, inputs_S, targets_S)
    for q in np.flatnonzero(validation['distances'][row] >= 0):
      p, value = pairs[int(inputs_S[q])]
      assert targets_S[q] == value
      assert q - p == validation['distances'][row, q]
      assert task.min_distance <= q - p <= task.max_distance


def test_one_token_pairs_keep_the_layout_and_the_distances(task, validation):
  """pair_tokens=1: each pair is one token (k, v) where its value was; the key's cell holds the
  filler it was given, and everything else (queries, answers, distances, the other cells) is
  the same sequence as the two-token task's."""
  joint = mqar.parse(SMALL + ',pair_tokens=1')
  assert joint.pair_tokens == 1 and mqar.parse(joint.spec) == joint and 'pair_tokens=1' in joint.spec
  assert 'pair_tokens' not in task.spec  # the default is not spelled: older specs are unchanged
  assert joint.vocab_size == task.vocab_size + task.keys * task.values
  tok = mqar.MqarTokenizer(joint)
  for index in range(8):
    x2, d2 = mqar.sequence(task, 'validation', index)
    x1, d1 = mqar.sequence(joint, 'validation', index)
    np.testing.assert_array_equal(d1, d2)
    pairs = [p for p in range(1, task.seq_len - task.latents) if task.key_start <= x2[p] < task.value_start]
    assert len(pairs) == task.pairs
    for p in pairs:  # the pair token at p + 1 names the key and the value of the two-token pair
      assert tok.decode([x1[p + 1]]) == f'k{x2[p] - task.key_start}=v{x2[p + 1] - task.value_start}'
      assert not task.key_start <= x1[p] < task.value_start  # no key outside the queries
    changed = np.flatnonzero(x1 != x2)
    assert set(changed) <= {c for p in pairs for c in (p, p + 1)}
    np.testing.assert_array_equal(tok.encode(tok.decode(x1)), x1)
  with pytest.raises(ConfigError, match=r'mqar:pair_tokens=3 must be 1 or 2'):
    mqar.parse(SMALL + ',pair_tokens=3')
  with pytest.raises(ConfigError, match=r'keys x values pair tokens = '):
    mqar.check(joint, joint.seq_len, vocab_size=task.vocab_size)

def test_distances_are_log_uniform(task):
  d_N = np.concatenate([mqar.sequence(task, 'train', i)[1] for i in range(1000)])
  d_N = d_N[d_N >= 0]
  n, num_bins = len(d_N), 8
  edges = mqar.distance_bins(task, num_bins)
  assert edges[0] == task.min_distance and np.isclose(edges[-1], task.max_distance + 1)
  counts = np.bincount(np.searchsorted(edges, d_N, side='right') - 1, minlength=num_bins)
  # d = floor(D), D log-uniform on [min, max + 1): a bin holds the integers from ceil(edge) on.
  whole = np.ceil(edges)
  p_bin = np.diff(np.log(whole)) / math.log((task.max_distance + 1) / task.min_distance)
  tolerance = 4 * np.sqrt(n * p_bin * (1 - p_bin))
  assert (np.abs(counts - n * p_bin) <= tolerance).all(), (counts, n * p_bin, tolerance)


# ----------------------------------------------------------------------------------------------
# Determinism, resume, processes.


def _same(a, b) -> bool:
  return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_deterministic(corpus, task):
  first = [next(corpus.train_iterator(seed=3)) for _ in range(2)]
  assert _same(first[0], first[1])
  it_a, it_b = corpus.train_iterator(seed=3), corpus.train_iterator(seed=3)
  for _ in range(3):
    assert _same(next(it_a), next(it_b))
  assert not _same(next(corpus.train_iterator(seed=3)), next(corpus.train_iterator(seed=4)))
  for a, b in zip(corpus.eval_batches('validation'), corpus.eval_batches('validation')):
    assert _same(a, b)
  assert not _same(next(corpus.eval_batches('validation')), next(corpus.eval_batches('test')))
  # Held-out sequences do not depend on the training seed; train's do.
  assert np.array_equal(mqar.sequence(task, 'test', 5, seed=0)[0], mqar.sequence(task, 'test', 5, seed=9)[0])
  assert not np.array_equal(mqar.sequence(task, 'train', 5, seed=0)[0],
                            mqar.sequence(task, 'train', 5, seed=9)[0])
  more = mqar.parse(SMALL.replace('eval_sequences=24', 'eval_sequences=40'))  # extends the set
  assert np.array_equal(mqar.sequence(more, 'test', 23)[0], mqar.sequence(task, 'test', 23)[0])
  with pytest.raises(ValueError, match='test sequence 24 does not exist'):
    mqar.sequence(task, 'test', 24)


def test_resume_continues_exactly(corpus):
  whole = corpus.train_iterator(batch_size=3, seed=1)
  expected = [next(whole) for _ in range(5)]
  assert set(expected[0]) == {'inputs', 'targets', 'weights'}  # what the compiled train step takes
  interrupted = corpus.train_iterator(batch_size=3, seed=1)
  for _ in range(2):
    next(interrupted)
  state = json.loads(json.dumps(interrupted.get_state()))
  resumed = corpus.train_iterator(batch_size=3, seed=1)
  resumed.set_state(state)
  for want in expected[2:]:
    assert _same(next(resumed), want)
  with pytest.raises(ValueError, match='train.seed'):
    corpus.train_iterator(batch_size=3, seed=2).set_state(state)


def test_process_sharding(corpus):
  single = corpus.train_iterator(batch_size=4, seed=2)
  shards = [corpus.train_iterator(batch_size=2, seed=2, process_index=i, process_count=2)
            for i in range(2)]
  for _ in range(3):
    whole, parts = next(single), [next(s) for s in shards]
    assert _same(whole, {k: np.concatenate([p[k] for p in parts]) for k in whole})
  single = list(corpus.eval_batches('validation', batch_size=10))  # 24 rows: 3 batches, 6 padded
  shards = [list(corpus.eval_batches('validation', batch_size=5, process_index=i, process_count=2))
            for i in range(2)]
  assert len(single) == len(shards[0]) == len(shards[1]) == 3
  for whole, *parts in zip(single, *shards):
    assert _same(whole, {k: np.concatenate([p[k] for p in parts]) for k in whole})
  last = single[-1]
  assert (last['weights'][4:] == 0).all() and (last['distances'][4:] == -1).all()
  assert sum(int(b['weights'].sum()) for b in single) == corpus.num_bytes('validation') == 24 * 8


# ----------------------------------------------------------------------------------------------
# The corpus interface and the tokenizer.


def test_corpus_interface(corpus, task, validation):
  S = task.seq_len
  assert corpus.splits == ('train', 'validation', 'test')
  assert corpus.num_documents('test') == corpus.num_windows('test') == 24
  assert corpus.num_tokens('validation') == 24 * S
  stream = corpus.tokens('validation')
  assert len(stream) == corpus.num_tokens('validation') + 1
  x = _windows(validation)
  for w in range(len(x)):
    np.testing.assert_array_equal(stream[w * S:w * S + S + 1], x[w])
  batch = next(corpus.eval_batches('validation'))
  assert set(batch) == {'inputs', 'targets', 'weights', 'distances'}
  assert all(v.shape == (4, S) for v in batch.values())
  assert batch['inputs'].dtype == batch['targets'].dtype == np.int32
  with pytest.raises(ValueError, match='generated batch by batch'):
    corpus.tokens('train')
  with pytest.raises(ValueError, match="no split 'dev'"):
    corpus.num_tokens('dev')
  with pytest.raises(ConfigError, match='seq_len=128 differs'):
    next(corpus.eval_batches('validation', seq_len=128))


def test_tokenizer(task, validation, tmp_path):
  tok = mqar.MqarTokenizer(task)
  assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.model_path) == (99, 1, 0, None)
  ids = tok.encode('k3 v2 f1 ? <eos> <pad>')
  np.testing.assert_array_equal(ids, [3 + 3, 67 + 2, 83 + 1, 2, 1, 0])
  assert tok.decode(ids) == 'k3 v2 f1 ? <eos> <pad>' and tok.decode([99]) == '<id:99>'
  row = _windows(validation)[0]
  np.testing.assert_array_equal(tok.encode(tok.decode(row)), row)
  with pytest.raises(ValueError, match="'k64' is not an MQAR token"):
    tok.encode('k64')
  tok.save(tmp_path / 'task.json')
  assert mqar.MqarTokenizer.load(tmp_path / 'task.json').task == task
  assert json.loads((tmp_path / 'task.json').read_text())['dataset'] == task.spec


# ----------------------------------------------------------------------------------------------
# Scoring.


def _oracle(task, batch):
  """The answers looked up in the pairs: argmax ids `[B, S]`."""
  predicted = np.zeros_like(batch['targets'])
  for row in range(len(predicted)):
    pairs = _pair_lookup(task, batch['inputs'][row], batch['targets'][row])
    for q in np.flatnonzero(batch['distances'][row] >= 0):
      predicted[row, q] = pairs[int(batch['inputs'][row, q])][1]
  return predicted


def test_scoring_oracle_and_guesser():
  task = mqar.parse(SMALL.replace('eval_sequences=24', 'eval_sequences=400'))
  corpus = mqar.MqarCorpus(task, batch_size=50)
  oracle, guesser = mqar.DistanceAccuracy(task), mqar.DistanceAccuracy(task)
  rng = np.random.default_rng(0)
  for b in corpus.eval_batches('test'):
    oracle.add(b['distances'], b['targets'], _oracle(task, b))
    guesses = rng.integers(task.value_start, task.filler_start, size=b['targets'].shape)
    guesser.add(b['distances'], b['targets'], guesses)
  right, chance = oracle.result(), guesser.result()
  json.dumps(right)
  assert right['count_all'] == 400 * task.queries == sum(right['count'])
  assert right['accuracy'] == [1.0] * 8 and right['stderr'] == [0.0] * 8
  assert min(right['count']) > 200  # every bin well filled
  p = 1 / task.values
  for acc, n, stderr in zip(chance['accuracy'], chance['count'], chance['stderr']):
    assert abs(acc - p) <= 3 * math.sqrt(p * (1 - p) / n)
    assert math.isclose(stderr, math.sqrt(acc * (1 - acc) / n))


def test_scoring_from_logits(task, validation):
  batch = {k: v[:4] for k, v in validation.items()}
  predicted = _oracle(task, batch)
  logits_BSV = np.eye(task.vocab_size, dtype=np.float32)[predicted]
  from_ids = mqar.accuracy_by_distance(task, batch['distances'], batch['targets'], predicted)
  assert from_ids['accuracy_all'] == 1.0 and from_ids['count_all'] == 4 * task.queries
  assert mqar.accuracy_by_distance(task, batch['distances'], batch['targets'], logits_BSV) == from_ids
  latents = logits_BSV[:, -task.latents:]  # Perceiver-AR: logits of the last Z positions only
  assert mqar.accuracy_by_distance(task, batch['distances'], batch['targets'], latents) == from_ids
  wrong = predicted.copy()
  wrong[batch['distances'] >= 0] = mqar.PAD_ID
  assert mqar.accuracy_by_distance(task, batch['distances'], batch['targets'], wrong)['accuracy_all'] == 0
  with pytest.raises(ValueError, match='must predict at least the last'):
    mqar.accuracy_by_distance(task, batch['distances'], batch['targets'], latents[:, -8:])
