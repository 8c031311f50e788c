"""data.dataset='text:<glob>': a folder of text files through the TFDS / tokenizer / Grain pipeline."""

import glob
import hashlib
import json
import logging
import math
import os
import random
import shutil

import ml_collections
import numpy as np
import pytest

from conftest import TINY, build, fake_work_text, load_config
from efficient_lm.config.data import DataConfig
from efficient_lm import data
from efficient_lm.config.errors import ConfigError
from efficient_lm.data import held_out
from efficient_lm.data import text_files
from efficient_lm.training import loop as train


def _mapping(data_dir, dataset: str, **overrides) -> ml_collections.ConfigDict:
  fields = dict(dataset=dataset, seq_len=16, batch_size=2, vocab_size=320, data_dir=str(data_dir),
                archive='', archive_sha256='', text_key='text', tokenizer_train_bytes=0,
                validation_fraction=0.05, test_fraction=0.05)
  fields.update(overrides)
  return ml_collections.ConfigDict(fields)


def _config(data_dir, dataset: str, **overrides):
  """The typed data section (`data.validate`), what the data functions take."""
  return data.validate(DataConfig.from_mapping(_mapping(data_dir, dataset, **overrides)))


def _write(root, files: dict) -> None:
  """Writes {relative path: str or bytes} under root (str as UTF-8)."""
  for relpath, payload in files.items():
    path = os.path.join(root, relpath)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'wb') as f:
      f.write(payload.encode('utf-8') if isinstance(payload, str) else payload)


def _folder(root, n: int, prefix: str = 'doc') -> dict[str, str]:
  """n fixture documents spread over nested folders; returns {relpath: text}."""
  files = {f'{("a/b/", "a/", "")[i % 3]}{prefix}{i:02d}.txt': fake_work_text(f'{prefix}{i}', lines=20)
           for i in range(n)}
  _write(root, files)
  return files


def _split_relpaths(text_scan) -> dict[str, list[str]]:
  return {s: [f.relpath for f in files] for s, files in text_scan.split_files().items()}


def _split_texts(corpus) -> dict[str, str]:
  """Each split's documents decoded from its token stream (end-of-document ids decode to '')."""
  return {s: corpus.tokenizer.decode(np.asarray(corpus.tokens(s))) for s in corpus.splits}


# ---------------------------------------------------------------------------------------------
# Splits.


def test_split_by_file_is_complete_and_deterministic(tmp_path, monkeypatch):
  files = _folder(tmp_path / 'notes', 20)
  dataset = f'text:{tmp_path}/notes/**/*.txt'
  text_scan = text_files.scan(dataset, 0.05, 0.05)
  assert not text_scan.by_bytes
  splits = _split_relpaths(text_scan)
  assigned = [r for relpaths in splits.values() for r in relpaths]
  assert sorted(assigned) == sorted(files) and len(assigned) == len(set(assigned))  # each exactly once
  assert {s: len(r) for s, r in splits.items()} == {'train': 18, 'validation': 1, 'test': 1}
  ranked = sorted(files, key=lambda r: hashlib.sha256(r.encode()).hexdigest())  # the documented rule
  assert splits['validation'] == ranked[:1] and splits['test'] == ranked[1:2]

  # The same files written in another order, in another folder: the same assignment.
  order = list(files)
  random.Random(0).shuffle(order)
  _write(tmp_path / 'copy', {r: files[r] for r in order})
  assert _split_relpaths(text_files.scan(f'text:{tmp_path}/copy/**/*.txt', 0.05, 0.05)) == splits
  # ... and whatever order the filesystem lists them in.
  real_glob = glob.glob
  monkeypatch.setattr(text_files.glob, 'glob', lambda *a, **k: list(reversed(real_glob(*a, **k))))
  assert _split_relpaths(text_files.scan(dataset, 0.05, 0.05)) == splits

  # Larger fractions; through the TFDS pipeline the splits hold exactly the assigned files.
  wide = text_files.scan(dataset, 0.25, 0.1)
  wide_splits = _split_relpaths(wide)
  assert {s: len(r) for s, r in wide_splits.items()} == {'train': 13, 'validation': 5, 'test': 2}
  corpus = data.load(_config(tmp_path / 'd', dataset, validation_fraction=0.25, test_fraction=0.1))
  assert corpus.splits == ('train', 'validation', 'test')
  for split, relpaths in wide_splits.items():
    assert corpus.num_documents(split) == len(relpaths)
    assert corpus.num_bytes(split) == sum(len(files[r].encode()) for r in relpaths)
  texts = _split_texts(corpus)
  for relpath in wide_splits['validation']:
    assert files[relpath] in texts['validation'] and files[relpath] not in texts['train']


def test_three_files_give_one_each_and_zero_fraction_drops_the_split(tmp_path):
  _folder(tmp_path, 3)
  dataset = f'text:{tmp_path}/**/*.txt'
  assert {s: len(r) for s, r in _split_relpaths(text_files.scan(dataset, 0.05, 0.05)).items()} == {
      'train': 1, 'validation': 1, 'test': 1}
  assert {s: len(r) for s, r in _split_relpaths(text_files.scan(dataset, 0.3, 0.0)).items()} == {
      'train': 2, 'validation': 1}


@pytest.mark.parametrize('seed', range(5))
def test_held_out_counts_follow_the_fractions(seed):
  rng = random.Random(seed)
  for _ in range(200):
    n = rng.randint(3, 60)
    fv = rng.choice([0.0, rng.uniform(0, 0.6)])
    ft = rng.choice([0.0, rng.uniform(0, 0.99 - fv)])
    counts = held_out.held_out_counts(n, {'validation': fv, 'test': ft})
    assert n - sum(counts.values()) >= 1  # train keeps a file
    for split, f in (('validation', fv), ('test', ft)):
      assert (counts[split] >= 1) == (f > 0)
      if n - 1 >= max(1, round(fv * n)) * (fv > 0) + max(1, round(ft * n)) * (ft > 0):
        assert counts[split] == (max(1, round(f * n)) if f > 0 else 0)  # not capped: the rounded share


def test_one_file_is_split_by_bytes_with_a_warning(tmp_path, caplog):
  lines = [f'line {i}: ' + 'x' * (i % 17) + ' é' * (i % 3) for i in range(400)]
  text = '\n'.join(lines) + '\n'
  _write(tmp_path / 'one', {'book.txt': text})
  dataset = f'text:{tmp_path}/one/*.txt'
  with caplog.at_level(logging.WARNING):
    corpus = data.load(_config(tmp_path / 'd', dataset, validation_fraction=0.1, test_fraction=0.2))
  warnings = [r.getMessage() for r in caplog.records if 'split by bytes' in r.getMessage()]
  assert len(warnings) == 1 and 'only 1 usable file' in warnings[0]
  assert corpus.splits == ('train', 'validation', 'test')
  assert all(corpus.num_documents(s) == 1 for s in corpus.splits)
  pieces = _split_texts(corpus)
  assert pieces['train'] + pieces['validation'] + pieces['test'] == text  # nothing lost or repeated
  assert pieces['train'].endswith('\n') and pieces['validation'].endswith('\n')  # cut at line starts
  size = len(text.encode())
  longest_line = max(len(line.encode()) + 1 for line in lines)
  assert sum(corpus.num_bytes(s) for s in corpus.splits) == size
  assert abs(corpus.num_bytes('test') - 0.2 * size) <= longest_line
  assert abs(corpus.num_bytes('validation') - 0.1 * size) <= 2 * longest_line


def test_two_files_are_each_split_by_bytes(tmp_path):
  files = _folder(tmp_path, 2)
  corpus = data.load(_config(tmp_path / 'd', f'text:{tmp_path}/**/*.txt', test_fraction=0.0))
  assert corpus.splits == ('train', 'validation')  # test_fraction 0: no test split
  assert corpus.num_documents('train') == 2 and corpus.num_documents('validation') == 2
  assert corpus.num_bytes('train') + corpus.num_bytes('validation') == sum(
      len(t.encode()) for t in files.values())


def test_cut_text_pieces():
  text = 'one\ntwo\nthree\nfour\nfive\nsix\nseven\neight\nnine\nten\n'
  pieces = text_files.cut_text(text, validation_fraction=0.2, test_fraction=0.2)
  assert ''.join(pieces[s] for s in ('train', 'validation', 'test')) == text
  assert all(p.endswith('\n') for p in pieces.values())
  assert pieces['test'] == 'nine\nten\n'  # the line start (byte 40) nearest 80% of the 49 bytes
  assert pieces['validation'] == 'seven\neight\n'  # ... and (byte 28) nearest 60%
  # One line: cut at character boundaries, never inside a multi-byte character.
  line = 'αβγδεζηθικλμ'
  pieces = text_files.cut_text(line, validation_fraction=0.25, test_fraction=0.25)
  assert pieces == {'train': 'αβγδεζ', 'validation': 'ηθι', 'test': 'κλμ'}
  # Too few lines for the targets: still non-empty pieces in order.
  pieces = text_files.cut_text('a\nb\nc', validation_fraction=0.01, test_fraction=0.01)
  assert pieces == {'train': 'a\n', 'validation': 'b\n', 'test': 'c'}
  assert text_files.cut_text('abc', validation_fraction=0, test_fraction=0) == {'train': 'abc'}
  with pytest.raises(data.DataError, match='cannot be cut'):
    text_files.cut_text('ab', validation_fraction=0.1, test_fraction=0.1)


def test_double_star_recurses_and_tilde_expands(tmp_path, monkeypatch):
  _write(tmp_path / 'corpus', {'top.txt': 'top\n', 'a/one.txt': 'one\n', 'a/b/c/deep.txt': 'deep\n',
                               'a/notes.md': 'not txt\n', '.hidden/h.txt': 'hidden\n',
                               'a/.dot.txt': 'dot\n'})
  monkeypatch.setenv('HOME', str(tmp_path))
  deep = text_files.scan('text:~/corpus/**/*.txt', 0.05, 0.05)
  assert deep.root == str(tmp_path / 'corpus')
  assert [f.relpath for f in deep.files] == ['a/b/c/deep.txt', 'a/one.txt', 'top.txt']
  flat = text_files.scan('text:~/corpus/*.txt', 0.05, 0.05)
  assert [f.relpath for f in flat.files] == ['top.txt']
  every = text_files.scan('text:~/corpus/**/*', 0.05, 0.05)  # directories are not documents
  assert [f.relpath for f in every.files] == ['a/b/c/deep.txt', 'a/notes.md', 'a/one.txt', 'top.txt']
  monkeypatch.chdir(tmp_path / 'corpus')  # a relative pattern: relative to the working directory
  assert [f.relpath for f in text_files.scan('text:a/**/*.txt', 0.05, 0.05).files] == [
      'b/c/deep.txt', 'one.txt']


# ---------------------------------------------------------------------------------------------
# Cache.


def test_cache_key_changes_when_a_file_changes(tmp_path):
  files = _folder(tmp_path / 'notes', 5)
  dataset = f'text:{tmp_path}/notes/**/*.txt'
  key = text_files.scan(dataset, 0.05, 0.05).cache_key
  assert text_files.scan(dataset, 0.05, 0.05).cache_key == key  # stable
  assert text_files.scan(dataset, 0.1, 0.05).cache_key != key  # the fractions count
  assert text_files.scan(dataset, 0.05, 0.1).cache_key != key
  shutil.copytree(tmp_path / 'notes', tmp_path / 'twin')  # same names, sizes and mtimes, elsewhere
  assert text_files.scan(f'text:{tmp_path}/twin/**/*.txt', 0.05, 0.05).cache_key != key

  config = _config(tmp_path / 'd', dataset)
  first = data.load(config)
  edited_relpath, removed_relpath = list(files)[2], list(files)[4]
  path = tmp_path / 'notes' / edited_relpath
  stat = os.stat(path)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: same bytes
  touched = text_files.scan(dataset, 0.05, 0.05).cache_key
  assert touched != key
  with open(path, 'a') as f:
    f.write('an added line\n')
  edited = text_files.scan(dataset, 0.05, 0.05).cache_key
  assert edited not in (key, touched)
  second = data.load(config)
  assert second.tokenizer.model_path != first.tokenizer.model_path  # prepared again
  assert sum(second.num_bytes(s) for s in second.splits) == sum(
      first.num_bytes(s) for s in first.splits) + len('an added line\n')
  assert os.path.isdir(tmp_path / 'd' / 'tfds' / 'text' / edited)
  assert 'an added line\n' in ''.join(_split_texts(second).values())
  os.remove(tmp_path / 'notes' / removed_relpath)  # a removed file, too
  assert text_files.scan(dataset, 0.05, 0.05).cache_key not in (key, touched, edited)


# ---------------------------------------------------------------------------------------------
# Bad input: one clear error, and (for what is known before preparing) nothing written.


@pytest.mark.parametrize('files,pattern,error,match', [
    ({}, '*.txt', ConfigError, r"^data\.dataset='text:.*' matches no file \(glob"),
    ({'sub/x.txt': 'text\n'}, 'sub', ConfigError, r'matches no file'),  # a directory is not a file
    ({'a.txt': b'\x89PNG\0\0', 'b.txt': b'x' * 8000 + b'\0'}, '*.txt', data.DataError,
     r"^data\.dataset='text:.*' matched 2 file\(s\) but none is usable text \(2 binary, 0 empty\)"),
    ({'a.txt': '', 'b.txt': '\ufeff'}, '*.txt', data.DataError,
     r'none is usable text \(0 binary, 2 empty\)'),
    ({'a.txt': 'x'}, '*.txt', data.DataError, r'a\.txt \(1 character\(s\)\) is too short to split'),
])
def test_bad_folders_are_one_error_and_write_nothing(tmp_path, files, pattern, error, match):
  _write(tmp_path / 'in', files)
  data_dir = tmp_path / 'never'
  with pytest.raises(error, match=match):
    data.load(_config(data_dir, f'text:{tmp_path}/in/{pattern}'))
  assert not data_dir.exists()


@pytest.mark.parametrize('overrides,match', [
    (dict(dataset='text:'), r"^data\.dataset='text:' is not a known dataset; .*text:<glob>"),
    (dict(dataset='text:   '), r"^data\.dataset='text:   ' is not a known dataset"),
    (dict(validation_fraction=1.0), r'^data\.validation_fraction=1\.0 must be a number in \[0, 1\)'),
    (dict(test_fraction=-0.1), r'^data\.test_fraction=-0\.1 must be a number in \[0, 1\)'),
    (dict(test_fraction='0.1'), r"^data\.test_fraction='0\.1' must be a number"),
    (dict(validation_fraction=True), r'^data\.validation_fraction=True must be a number'),
    (dict(validation_fraction=0.5, test_fraction=0.5),
     r'^data\.validation_fraction=0\.5 plus data\.test_fraction=0\.5 must be below 1'),
    (dict(archive='ARCHIVE'), r"^data\.archive=.* is only used by the shakespeare, wikitext103, "
                              r"python_code datasets; set data\.archive to '' for text:"),
])
def test_bad_config_fields_name_the_field(tmp_path, overrides, match):
  _folder(tmp_path / 'in', 3)
  archive = tmp_path / 'a.tar.gz'
  archive.write_bytes(b'')
  if overrides.get('archive') == 'ARCHIVE':
    overrides = dict(overrides, archive=str(archive))
  overrides = {'dataset': f'text:{tmp_path}/in/**/*.txt', **overrides}
  config = _mapping(tmp_path / 'never', overrides.pop('dataset'), **overrides)
  with pytest.raises(ConfigError, match=match):
    data.validate(DataConfig.from_mapping(config))
  with pytest.raises(TypeError, match=r"^data\.load takes the typed data section \(a RunConfig's data"):
    data.load(config)  # never the mapping: its caller types it (data.validate) first
  assert not (tmp_path / 'never').exists()


def test_fractions_default_when_a_config_lacks_them(tmp_path):
  _folder(tmp_path / 'in', 20)
  config = _mapping(tmp_path / 'd', f'text:{tmp_path}/in/**/*.txt')
  del config['validation_fraction'], config['test_fraction']
  corpus = data.load(data.validate(DataConfig.from_mapping(config)))
  assert [corpus.num_documents(s) for s in corpus.splits] == [18, 1, 1]


def test_utf8_repair_and_binary_skip_counts(tmp_path, caplog):
  files = {name: fake_work_text(name, lines=10) for name in ('good1', 'good2', 'good3')}
  files['crlf'] = 'windows\r\nline ends\r\n'
  files['broken'] = b'valid start \xff\xfe broken \xc3\n'
  files['late_nul'] = b'y' * 9000 + b'\0 a NUL after the first 8 KiB is text\n'
  files['bin_early'] = b'\x7fELF\0\0\0' + b'z' * 100
  files['bin_edge'] = b'w' * 8191 + b'\0'  # the 8192nd byte: still inside the sniffed head
  files['empty'] = b''
  _write(tmp_path / 'in', {f'{name}.txt': payload for name, payload in files.items()})
  dataset = f'text:{tmp_path}/in/*.txt'
  with caplog.at_level(logging.INFO):
    corpus = data.load(_config(tmp_path / 'd', dataset))
  count_lines = [r for r in caplog.records if 'matched; skipped' in r.getMessage()]
  assert len(count_lines) == 1 and count_lines[0].levelno == logging.WARNING
  assert count_lines[0].getMessage() == (
      f'{dataset}: 6 text file(s) of 9 matched; skipped 2 binary and 1 empty; repaired 1 with '
      'invalid UTF-8 (now U+FFFD)')
  text_scan = text_files.scan(dataset, 0.05, 0.05)
  assert (text_scan.num_binary, text_scan.num_empty, text_scan.num_repaired) == (2, 1, 1)
  assert sorted(f.relpath for f in text_scan.files) == sorted(
      f'{n}.txt' for n in ('good1', 'good2', 'good3', 'crlf', 'broken', 'late_nul'))
  everything = ''.join(_split_texts(corpus).values())
  assert 'valid start \ufffd\ufffd broken \ufffd\n' in everything  # each bad byte one U+FFFD
  assert 'windows\nline ends\n' in everything and '\r' not in everything
  assert '\0 a NUL after the first 8 KiB is text\n' in everything
  assert 'ELF' not in everything and 'w' * 100 not in everything


@pytest.mark.slow
def test_train_split_shorter_than_seq_len_stops_before_training(tmp_path):
  _write(tmp_path / 'in', {'a.txt': 'a short note\n', 'b.txt': 'another one\n', 'c.txt': 'third\n'})
  config = load_config('dense')
  for section, fields in TINY.items():
    config[section].update(fields)
  config.data.update(dataset=f'text:{tmp_path}/in/*.txt', data_dir=str(tmp_path / 'd'), seq_len=512)
  workdir = tmp_path / 'run'
  too_short = (r"^data\.dataset='text:.*' has \d+ tokens in its train split, fewer than one batch "
               r"of windows \(data\.batch_size=4 x \(data\.seq_len=512 \+ 1\) = 2,052\); give it more "
               r"text, or lower data\.batch_size or data\.seq_len$")
  with pytest.raises(data.DataError, match=too_short):
    train.train_and_evaluate(build(config), str(workdir))
  assert not workdir.exists()  # refused before the workdir is written
  with pytest.raises(ConfigError, match=r"^data\.seq_len=512 is longer than the 'train' split"):
    data.load(data.validate(DataConfig.from_mapping(config.data))).train_iterator()  # (the iterator's own check stays)
  # Evaluation splits shorter than seq_len are fine: one padded window scores every token.
  corpus = data.load(data.validate(DataConfig.from_mapping(config.data)))
  batches = list(corpus.eval_batches('validation', batch_size=2))
  assert len(batches) == 1 and batches[0]['weights'].sum() == corpus.num_tokens('validation')


# ---------------------------------------------------------------------------------------------
# End to end.


@pytest.mark.slow
def test_pi_attention_trains_on_a_text_folder(tmp_path):
  _folder(tmp_path / 'notes', 12, prefix='note')
  config = load_config('pi_attention')
  for section, fields in TINY.items():
    config[section].update(fields)
  config.data.update(dataset=f'text:{tmp_path}/notes/**/*.txt', data_dir=str(tmp_path / 'd'),
                     validation_fraction=0.1, test_fraction=0.1)
  config.train.update(num_steps=20, eval_every=10, checkpoint_every=10, sample_prompt='')
  workdir = tmp_path / 'run'
  summary = train.train_and_evaluate(build(config), str(workdir))
  with open(workdir / 'metrics.jsonl') as f:
    records = [json.loads(line) for line in f]
  losses = [r['loss'] for r in records if 'loss' in r]
  evals = [r for r in records if 'eval_loss' in r]
  assert len(losses) == 4 and losses[-1] < losses[0] - 0.3
  assert [r['step'] for r in evals] == [10, 20] and evals[-1]['eval_loss'] < evals[0]['eval_loss']
  assert summary['step'] == 20 and math.isfinite(summary['eval_bits_per_byte'])
  assert 0 < summary['eval_bits_per_byte'] < 8
  assert (workdir / 'tokenizer.model').is_file()
