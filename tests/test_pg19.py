"""`tfds:pg19`, the long-book benchmark: TFDS's own PG-19 builder, prepared as ArrayRecord and read
as the library reads any `tfds:<name>`, reaches a training step.

Nothing can be downloaded here, and `tfds.testing.mock_data` cannot serve the path the library
takes (checked with tensorflow-datasets 4.9): with no metadata files (its pip wheel ships none)
the mocked builder has no splits, so `pipeline.load` stops at "has no documents in its train
split"; given a dataset_info.json, its mocked ArrayRecord data source sets `__getitems__` on a
MagicMock instance, unbound, and the batched read TFDS's data source makes (`cache.documents`
reads 256 records at a time) fails with a TypeError. So the test runs the real builder
(`tensorflow_datasets.datasets.pg19`) on a local folder in PG-19's layout (metadata.csv, and
train/, validation/, test/ of `<book_id>.txt`, fixture text): its `_DATA_DIR`
(gs://deepmind-gutenberg) points at that folder, and its `tf.io.gfile` (TensorFlow is not
installed) is two functions over the local filesystem, `listdir` and `GFile`. Everything else,
the builder's features and split generation, TFDS's ArrayRecord writer and data source, the
tokenizer, the token cache and the training loop, is the real code.
"""

import json
import os
import types

import pytest

from conftest import build, fake_work_text
from efficient_lm.config.data import DataConfig
from efficient_lm import data
from efficient_lm.training import loop as train

BOOKS = {'train': (101, 102, 103, 104), 'validation': (201,), 'test': (301,)}


def test_the_builder_and_its_features():
  """TFDS's builder and its info load without TensorFlow (this environment has none: setup.py does
  not install it); preparing it is what needs TensorFlow's gfile, for gs://deepmind-gutenberg."""
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  builder = tfds.builder('pg19', data_dir='/nonexistent', file_format='array_record')
  assert (builder.name, str(builder.version)) == ('pg19', '0.1.1')
  assert sorted(builder.info.features) == ['book_id', 'book_link', 'book_text', 'book_title',
                                           'publication_date']
  assert not builder.is_prepared()


@pytest.fixture
def pg19_from_local_files(tmp_path, monkeypatch):
  """The PG-19 builder reading a local folder in PG-19's layout (the module docstring says why)."""
  from tensorflow_datasets.datasets.pg19 import pg19_dataset_builder  # pylint: disable=import-outside-toplevel
  source = tmp_path / 'deepmind-gutenberg'
  rows = []
  for split, books in BOOKS.items():
    (source / split).mkdir(parents=True)
    for book in books:
      (source / split / f'{book}.txt').write_text(fake_work_text(f'book{book}', 120))
      rows.append(f'{book},Book {book},1900,https://www.gutenberg.org/ebooks/{book}')
  (source / 'metadata.csv').write_text('\n'.join(rows) + '\n')
  gfile = types.SimpleNamespace(listdir=os.listdir, GFile=open)
  monkeypatch.setattr(pg19_dataset_builder, 'tf', types.SimpleNamespace(io=types.SimpleNamespace(gfile=gfile)))
  monkeypatch.setattr(pg19_dataset_builder, '_DATA_DIR', str(source))
  return source


def test_pg19_reaches_a_training_step(pg19_from_local_files, tiny_config, tmp_path):
  config = tiny_config(num_steps=2, eval_every=2, checkpoint_every=2, log_every=1, sample_prompt='')
  config.data.update(dataset='tfds:pg19', text_key='book_text', archive='', archive_sha256='',
                     data_dir=str(tmp_path / 'data'))
  config.model.num_layers = 1
  corpus = data.load(data.validate(DataConfig.from_mapping(config.data)))
  assert corpus.splits == ('train', 'validation', 'test')
  assert [corpus.num_documents(s) for s in corpus.splits] == [4, 1, 1]  # one book a document
  book = fake_work_text('book201', 120).strip()  # the builder strips each book
  assert corpus.num_bytes('validation') == len(book.encode('utf-8'))
  assert corpus.tokenizer.decode(corpus.tokens('validation')) == book
  assert corpus.num_windows('validation') > 10  # a book spans many windows
  prepared = os.listdir(tmp_path / 'data' / 'tfds' / 'pg19' / '0.1.1')
  assert 'pg19-train.array_record-00000-of-00001' in prepared
  summary = train.train_and_evaluate(build(config), str(tmp_path / 'w'))
  assert summary['step'] == 2
  metrics = [json.loads(line) for line in open(tmp_path / 'w' / 'metrics.jsonl')]
  steps = [r['step'] for r in metrics if 'loss' in r]
  assert steps == [1, 2]
  assert json.load(open(tmp_path / 'w' / 'data.json'))['dataset'] == 'tfds:pg19'
