"""data.dataset='hf:<path>': a Hugging Face `datasets` dataset through the TFDS / tokenizer / Grain
pipeline. Every dataset here is written by the test (jsonl, parquet, save_to_disk, a fabricated
hub cache entry); the datasets cache and HF_HOME live under tmp_path and the hub is offline."""

import glob
import json
import math
import os
import shlex
import shutil
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from conftest import REPO, TINY, fake_work_text, subprocess_env
from efficient_lm.config.data import DataConfig
from efficient_lm import data
from efficient_lm.config.errors import ConfigError
from efficient_lm.data import hf_datasets
from efficient_lm.data.config import DataError

datasets = pytest.importorskip('datasets')


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch):
  """HF_HOME and the datasets cache under tmp_path, the hub offline (set where `datasets` and
  `huggingface_hub` read them: their module constants, already read at import)."""
  from huggingface_hub import constants  # pylint: disable=import-outside-toplevel

  home = tmp_path / 'hf_home'
  env = dict(HF_HOME=str(home), HF_DATASETS_CACHE=str(home / 'datasets'),
             HF_HUB_CACHE=str(home / 'hub'), HF_DATASETS_OFFLINE='1', HF_HUB_OFFLINE='1')
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setattr(datasets.config, 'HF_DATASETS_CACHE', env['HF_DATASETS_CACHE'])
  monkeypatch.setattr(datasets.config, 'HF_HUB_OFFLINE', True)
  monkeypatch.setattr(constants, 'HF_HUB_CACHE', env['HF_HUB_CACHE'])
  monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)
  return env


def _mapping(data_dir, dataset: str, **overrides) -> ml_collections.ConfigDict:
  fields = dict(dataset=dataset, seq_len=16, batch_size=2, vocab_size=320, data_dir=str(data_dir),
                archive='', archive_sha256='', text_key='content', tokenizer_train_bytes=0,
                validation_fraction=0.05, test_fraction=0.05, hf_allow_download=False)
  fields.update(overrides)
  return ml_collections.ConfigDict(fields)


def _config(data_dir, dataset: str, **overrides):
  """The typed data section (`data.validate`), what the data functions take."""
  return data.validate(DataConfig.from_mapping(_mapping(data_dir, dataset, **overrides)))


def _rows(prefix: str, n: int) -> list[dict]:
  return [{'content': fake_work_text(f'{prefix}{i}', lines=8), 'id': i} for i in range(n)]


def _write_jsonl(folder, splits: dict[str, list[dict]]) -> None:
  """{file stem: rows} as <folder>/<stem>.jsonl."""
  os.makedirs(folder, exist_ok=True)
  for stem, rows in splits.items():
    with open(os.path.join(folder, f'{stem}.jsonl'), 'w', encoding='utf-8') as f:
      for row in rows:
        f.write(json.dumps(row, ensure_ascii=False) + '\n')


def _documents(corpus, split: str) -> list[str]:
  """The split's documents decoded from its token stream, cut at the end-of-document ids."""
  tokens = np.asarray(corpus.tokens(split))
  cuts = np.flatnonzero(tokens == corpus.tokenizer.eos_id)
  return [corpus.tokenizer.decode(tokens[a + 1:b]) for a, b in zip(cuts[:-1], cuts[1:])]


def _utf8_bytes(rows) -> int:
  return sum(len(r['content'].encode('utf-8')) for r in rows)


# ---------------------------------------------------------------------------------------------
# Sources.


def test_jsonl_folder_gives_its_splits_documents_and_bytes(tmp_path):
  rows = {'train': _rows('train', 12), 'valid': _rows('valid', 3), 'test': _rows('test', 2)}
  _write_jsonl(tmp_path / 'corpus', rows)
  corpus = data.load(_config(tmp_path / 'd', f'hf:{tmp_path}/corpus'))
  assert corpus.splits == ('train', 'validation', 'test')  # 'valid' is validation, as datasets has it
  for split, stem in (('train', 'train'), ('validation', 'valid'), ('test', 'test')):
    assert corpus.num_documents(split) == len(rows[stem])
    assert corpus.num_bytes(split) == _utf8_bytes(rows[stem])  # bits per byte's denominator
    assert _documents(corpus, split) == [r['content'] for r in rows[stem]]  # one row, one document
  # Documents carry segment ids: a window that crosses an end-of-document token changes id there.
  batch = next(corpus.eval_batches('train', batch_size=4, seq_len=128))
  eos = batch['inputs'] == corpus.tokenizer.eos_id
  assert eos.any() and np.array_equal(batch['segment_ids'], np.cumsum(eos, axis=1))
  # Training batches resume exactly from a saved iterator state.
  it = corpus.train_iterator(batch_size=2, seed=3)
  next(it)
  state = it.get_state()
  expected = [next(it)['inputs'] for _ in range(3)]
  resumed = corpus.train_iterator(batch_size=2, seed=3)
  resumed.set_state(state)
  assert all(np.array_equal(next(resumed)['inputs'], e) for e in expected)
  # A second load reads the caches: the same streams, nothing prepared again.
  again = data.load(_config(tmp_path / 'd', f'hf:{tmp_path}/corpus'))
  assert np.array_equal(np.asarray(again.tokens('test')), np.asarray(corpus.tokens('test')))
  assert len(glob.glob(str(tmp_path / 'd' / 'tfds' / 'hf' / '*'))) == 1


def test_parquet_without_validation_holds_out_train_rows(tmp_path):
  pa = pytest.importorskip('pyarrow')
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  rows = _rows('doc', 40)
  os.makedirs(tmp_path / 'pq')
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / 'pq' / 'train.parquet')
  config = _config(tmp_path / 'd', f'hf:{tmp_path}/pq', validation_fraction=0.1, test_fraction=0.05)
  resolved = hf_datasets.resolve(config)
  assert resolved.held_out == {'validation': 0.1, 'test': 0.05}
  assert resolved.num_rows == {'train': 34, 'validation': 4, 'test': 2}
  corpus = data.load(config, resolved)
  kept = hf_datasets.held_out_rows(40, {'validation': 0.1, 'test': 0.05})
  assert sorted(np.concatenate(list(kept.values())).tolist()) == list(range(40))  # each row once
  assert kept['validation'].tolist() != list(range(4))  # spread over the rows, not the first ones
  for split in ('train', 'validation', 'test'):
    assert _documents(corpus, split) == [rows[i]['content'] for i in kept[split]]
  # Deterministic: the same rows on a second resolve, whatever the process.
  again = hf_datasets.held_out_rows(40, {'validation': 0.1, 'test': 0.05})
  assert all(np.array_equal(kept[s], again[s]) for s in kept)
  # A fraction of 0 makes no such split; the dataset's own test split is never held out again.
  _write_jsonl(tmp_path / 'two', {'train': rows[:20], 'test': rows[20:25]})
  resolved = hf_datasets.resolve(_config(tmp_path / 'd', f'hf:{tmp_path}/two',
                                         validation_fraction=0, test_fraction=0.2))
  assert resolved.held_out == {} and resolved.num_rows == {'train': 20, 'test': 5}


def test_save_to_disk_folders(tmp_path):
  rows = _rows('saved', 10)
  splits = datasets.DatasetDict({'train': datasets.Dataset.from_list(rows[:8]),
                                 'dev': datasets.Dataset.from_list(rows[8:])})
  splits.save_to_disk(str(tmp_path / 'dict'))
  corpus = data.load(_config(tmp_path / 'd', f'hf:{tmp_path}/dict', test_fraction=0))
  assert corpus.splits == ('train', 'validation')  # 'dev' is validation
  assert _documents(corpus, 'validation') == [r['content'] for r in rows[8:]]
  # A saved Dataset (no splits) is the train split; validation is held out of it.
  datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / 'one'))
  corpus = data.load(_config(tmp_path / 'd', f'hf:{tmp_path}/one', validation_fraction=0.2,
                             test_fraction=0))
  assert {s: corpus.num_documents(s) for s in corpus.splits} == {'train': 8, 'validation': 2}
  with pytest.raises(ConfigError, match=r"a save_to_disk folder has no config names; drop ':x'"):
    hf_datasets.resolve(_config(tmp_path / 'd', f'hf:{tmp_path}/one:x'))


def _fake_hub_cache(tmp_path, hf_home, repo: str) -> list[dict]:
  """`repo` ('owner/name') in the datasets cache as a download leaves it: a folder's Arrow files
  under <cache>/owner___name/<config>/<version>/<hash>/. Returns its train rows."""
  rows = _rows('hub', 6)
  _write_jsonl(tmp_path / 'src', {'train': rows, 'test': _rows('hubtest', 2)})
  datasets.load_dataset(str(tmp_path / 'src'))
  cache = hf_home['HF_DATASETS_CACHE']
  (built,) = [p for p in glob.glob(f'{cache}/src/default/*/*') if os.path.isdir(p)]
  owner, name = repo.split('/')
  target = os.path.join(cache, f'{owner}___{name}', *built.split(os.sep)[-3:])
  shutil.copytree(built, target)
  for path in glob.glob(f'{target}/src-*.arrow'):
    os.rename(path, path.replace('/src-', f'/{name}-'))
  info_path = os.path.join(target, 'dataset_info.json')
  with open(info_path) as f:
    info = json.load(f)
  with open(info_path, 'w') as f:
    json.dump(dict(info, dataset_name=name), f)
  return rows


def test_hub_name_is_read_from_the_cache_offline(tmp_path, hf_home, monkeypatch):
  rows = _fake_hub_cache(tmp_path, hf_home, 'someone/tiny')
  # Even where the user's environment is online, nothing is downloaded unless allowed.
  from huggingface_hub import constants  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(datasets.config, 'HF_HUB_OFFLINE', False)
  monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', False)
  monkeypatch.delenv('HF_DATASETS_OFFLINE')
  monkeypatch.delenv('HF_HUB_OFFLINE')
  seen = []
  real_load = datasets.load_dataset
  monkeypatch.setattr(datasets, 'load_dataset', lambda *a, **k: (
      seen.append((datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE,
                   os.environ.get('HF_DATASETS_OFFLINE'))), real_load(*a, **k))[1])
  corpus = data.load(_config(tmp_path / 'd', 'hf:someone/tiny:default', validation_fraction=0.2))
  assert seen and all(s == (True, True, '1') for s in seen)
  assert (datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE) == (False, False)  # restored
  assert 'HF_DATASETS_OFFLINE' not in os.environ
  assert corpus.splits == ('train', 'validation', 'test')
  assert corpus.num_documents('train') + corpus.num_documents('validation') == len(rows)
  # data.hf_allow_download=True leaves the environment's setting (online here) alone.
  seen.clear()
  hf_datasets.resolve(_config(tmp_path / 'd', f'hf:{tmp_path}/src', hf_allow_download=True))
  assert seen == [(False, False, None)]
  with pytest.raises(ConfigError, match=r"^data\.dataset='hf:someone/missing' is not a local folder "
                     r'and not in the datasets cache \(.*\), and downloads are off; set '
                     r'data\.hf_allow_download=True to download it'):
    hf_datasets.resolve(_config(tmp_path / 'd', 'hf:someone/missing'))
  with pytest.raises(ConfigError, match=r"^data\.dataset='hf:someone/tiny:other' cannot be loaded "
                     r"\(ValueError: Couldn't find cache for someone/tiny for config 'other'\)"):
    hf_datasets.resolve(_config(tmp_path / 'd', 'hf:someone/tiny:other'))


# ---------------------------------------------------------------------------------------------
# Checks: one line, naming the field and the fix.


def test_text_column_errors_list_the_columns(tmp_path):
  _write_jsonl(tmp_path / 'c', {'train': _rows('a', 4)})
  with pytest.raises(ConfigError, match=r"^data\.text_key='body' is not a column of hf:.*/c "
                     r"\(split 'train'\); use one of \['content', 'id'\]$"):
    hf_datasets.resolve(_config(tmp_path / 'd', f'hf:{tmp_path}/c', text_key='body'))
  with pytest.raises(ConfigError, match=r"^data\.text_key='id' is a column of .*int64.* not text; "
                     r"use one of \['content'\]$"):
    hf_datasets.resolve(_config(tmp_path / 'd', f'hf:{tmp_path}/c', text_key='id'))


@pytest.mark.parametrize('make,dataset,error,match', [
    (None, 'hf:{tmp}/absent', ConfigError, r'/absent is not a folder .*; fix the path'),
    ('file', 'hf:{tmp}/c/train.jsonl', ConfigError, r'is a file; point hf: at the folder'),
    ('empty', 'hf:{tmp}/e', ConfigError, r"^data\.dataset='hf:.*/e' cannot be loaded"),
    ('test_only', 'hf:{tmp}/c', DataError, r"has no train split \(splits: \['test'\]\)"),
    ('one_row', 'hf:{tmp}/c', DataError, r'has 1 train row\(s\), too few to hold out validation'),
    (None, 'hf:', ConfigError, r"^data\.dataset='hf:' is not a known dataset; .*hf:<path>"),
    ('one_row', 'hf:{tmp}/c', ConfigError, r'^data\.hf_allow_download=.yes. must be True or False'),
])
def test_bad_datasets_are_one_error_line(tmp_path, make, dataset, error, match):
  if make == 'file' or make == 'one_row':
    _write_jsonl(tmp_path / 'c', {'train': _rows('a', 1)})
  elif make == 'test_only':
    _write_jsonl(tmp_path / 'c', {'test': _rows('a', 3)})
  elif make == 'empty':
    os.makedirs(tmp_path / 'e')
  overrides = {'test_fraction': 0}
  if 'hf_allow_download' in match:
    overrides['hf_allow_download'] = 'yes'
  config = _mapping(tmp_path / 'd', dataset.format(tmp=tmp_path), **overrides)
  with pytest.raises(error, match=match) as caught:
    data.preflight(data.validate(DataConfig.from_mapping(config)))
  assert len(str(caught.value).splitlines()) == 1
  assert not (tmp_path / 'd').exists()  # nothing prepared


def test_parse_and_split_names(tmp_path):
  assert hf_datasets.parse('hf:wikitext:wikitext-2-raw-v1') == ('wikitext', 'wikitext-2-raw-v1')
  assert hf_datasets.parse('hf:owner/name') == ('owner/name', None)
  odd = tmp_path / 'a:b'  # an existing folder is never cut at its ':'
  odd.mkdir()
  assert hf_datasets.parse(f'hf:{odd}') == (str(odd), None)
  assert hf_datasets.canonical_splits(['dev', 'training', 'eval', 'extra.x']) == {
      'train': 'training', 'validation': 'dev', 'test': 'eval', 'extra_x': 'extra.x'}
  assert hf_datasets.canonical_splits(['train', 'validation', 'valid']) == {
      'train': 'train', 'validation': 'validation', 'valid': 'valid'}


def test_cache_key_follows_the_files_and_settings(tmp_path):
  _write_jsonl(tmp_path / 'c', {'train': _rows('a', 6), 'test': _rows('b', 2)})
  config = _config(tmp_path / 'd', f'hf:{tmp_path}/c')
  key = hf_datasets.resolve(config).cache_key
  assert hf_datasets.resolve(config).cache_key == key
  assert data.preflight(config, read=False).cache_key == key  # the other processes of a job
  assert hf_datasets.resolve(_config(tmp_path / 'd', f'hf:{tmp_path}/c',
                                     validation_fraction=0.3)).cache_key != key
  _write_jsonl(tmp_path / 'c', {'train': _rows('a', 7)})  # a row more in train.jsonl
  changed = hf_datasets.resolve(config)
  assert changed.cache_key != key and changed.num_rows['train'] + 1 == 7


# ---------------------------------------------------------------------------------------------
# End to end: the command line.


def _documented_command() -> list[str]:
  """The `python -m efficient_lm.main` command of docs/data.md's hf section, as argv after -m."""
  with open(os.path.join(REPO, 'docs', 'data.md'), encoding='utf-8') as f:
    section = f.read().split('## Hugging Face datasets', 1)[1].split('\n## ', 1)[0]
  block = section.split('    python -m efficient_lm.main', 1)[1].split('\n\n', 1)[0]
  return shlex.split(block.replace('\\\n', ' '))


@pytest.mark.slow
def test_pi_attention_trains_on_an_hf_folder_from_the_command_line(tmp_path, hf_home):
  """docs/data.md's command, on a tiny folder of jsonl files (tiny model, 10 steps)."""
  rows = {'train': _rows('train', 24), 'validation': _rows('valid', 3), 'test': _rows('test', 3)}
  _write_jsonl(tmp_path / 'corpus', rows)
  workdir = tmp_path / 'run'
  documented = _documented_command()
  assert '--config.data.dataset=hf:~/corpora/mine' in documented
  args = [a.replace('hf:~/corpora/mine', f'hf:{tmp_path}/corpus')
           .replace('--workdir=runs/mine', f'--workdir={workdir}') for a in documented]
  args += [f'--config.data.data_dir={tmp_path / "d"}', '--config.train.num_steps=10',
           '--config.train.eval_every=10', '--config.train.checkpoint_every=10',
           '--config.train.sample_tokens=0']
  for section in ('data', 'model', 'mesh'):
    args += [f'--config.{section}.{k}={v}' for k, v in TINY[section].items()]
  done = subprocess.run([sys.executable, '-m', 'efficient_lm.main', *args], capture_output=True,
                        text=True, cwd=REPO, timeout=600, env=subprocess_env(**hf_home))
  assert done.returncode == 0, done.stderr[-3000:]
  config = json.loads((workdir / 'config.json').read_text())
  assert config['data']['dataset'] == f'hf:{tmp_path}/corpus' and config['model']['name'] == 'pi_attention'
  # The Corpus(...) line gives each split's tokens: those of the corpus the run prepared.
  corpus = data.load(_config(tmp_path / 'd', f'hf:{tmp_path}/corpus', vocab_size=384,
                             tokenizer_train_bytes=20_000_000))  # the run's settings
  assert repr(corpus).startswith(f'Corpus(hf:{tmp_path}/corpus, vocab=384, tokens: train=')
  assert repr(corpus) in done.stderr + done.stdout
  assert corpus.num_bytes('validation') == _utf8_bytes(rows['validation'])
  summary = json.loads(done.stdout.strip().splitlines()[-1])
  assert summary['step'] == 10 and math.isfinite(summary['eval_bits_per_byte'])
  assert 0 < summary['eval_bits_per_byte'] < 8
  assert (workdir / 'tokenizer.model').is_file()
