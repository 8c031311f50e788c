"""Preparing and loading a corpus: `load(data_config)` -> `corpus.Corpus`, of the typed data
section (`data.validate(config.data)`, or the edge's `config_check.prepare(config).data`).

    source (registry) -> TFDS builder (prepared once, ArrayRecord) -> tokenizer and token streams
    (cache) -> Corpus (its Grain iterators)

Everything is cached under `data.data_dir`; a second call only memory-maps the token files.
"""

import functools
import logging
import os
import time

from efficient_lm import files
from efficient_lm.data import archives
from efficient_lm.data import cache
from efficient_lm.data import config as data_config_lib
from efficient_lm.data import corpus as corpus_lib
from efficient_lm.data import registry
from efficient_lm.data.config import DataError, TEXT_PREFIX, TFDS_PREFIX
from efficient_lm.data_config import DataConfig
from efficient_lm.validation import ConfigError, require

log = logging.getLogger(__name__)


def make_builder(data_config: DataConfig, tfds_dir: str, text_scan=None):
  """The prepared TFDS builder for `data.dataset` (prepares it on first use).

  `text_scan`: for text:<glob>, the checked file list (text_files.scan), made before anything is written.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  ds = data_config.dataset
  source = registry.lookup(ds)
  if ds.startswith(registry.HF_PREFIX):  # text_scan: what hf_datasets.resolve found
    from efficient_lm.data import hf_datasets  # pylint: disable=g-import-not-at-top
    builder = hf_datasets.make_builder(text_scan, tfds_dir)
  elif text_scan is not None:
    from efficient_lm.data import text_files  # pylint: disable=g-import-not-at-top
    builder = text_files.make_builder(text_scan, tfds_dir)
  elif source.builder:
    builder = source.builder_class()(data_dir=tfds_dir, file_format='array_record',
                                     archive=data_config.archive,
                                     archive_sha256=data_config.archive_sha256)
  else:
    name = ds[len(TFDS_PREFIX):].strip()
    try:
      builder = tfds.builder(name, data_dir=tfds_dir, file_format='array_record')
    except Exception as e:  # pylint: disable=broad-except  (unknown name, bad config name, ...)
      raise ConfigError(f'data.dataset={ds!r} cannot be built by TFDS ({type(e).__name__}: {e}); '
                        'use a name from tfds.list_builders()') from e
  if builder.is_prepared():
    return builder
  tfds.disable_progress_bar()
  log.info('Preparing %s in %s (ArrayRecord)...', ds, tfds_dir)
  start = time.time()
  builder.download_and_prepare()
  log.info('Prepared %s in %.1f s', ds, time.time() - start)
  return builder


def preflight(data_config: DataConfig, read: bool = True):
  """The checks of the data that read no more than the config names and write nothing (a
  `text:` glob that matches no usable file): before anything compiles. What it found, for `load`.
  `read=False`: the files are listed, not read (the processes other than 0 of a job).
  `data_config`: the typed section, its fields checked (`data.validate`)."""
  data_config_lib.check_typed(data_config, 'data.preflight')
  dataset = data_config.dataset
  if dataset.startswith(registry.NEEDLE_PREFIX):  # its options, then its base's checks
    from efficient_lm.data import needle  # pylint: disable=g-import-not-at-top
    return needle.preflight(data_config, read, preflight)
  if dataset.startswith(registry.HF_PREFIX):  # loaded and checked (hf_datasets.py)
    from efficient_lm.data import hf_datasets  # pylint: disable=g-import-not-at-top
    return hf_datasets.resolve(data_config)
  if not dataset.startswith(TEXT_PREFIX):
    return None
  from efficient_lm.data import text_files  # pylint: disable=g-import-not-at-top
  return text_files.scan(dataset, data_config.validation_fraction, data_config.test_fraction,
                         read=read)


_UNCHECKED = object()  # `load` without what `preflight` returned (which may be None)


def load(data_config: DataConfig, checked=_UNCHECKED,
         tokenizer_file: str = '') -> corpus_lib.Corpus:
  """Prepares the dataset of the typed data section (its fields checked: `data.validate`),
  trains/loads the tokenizer, tokenizes splits.

  Everything is cached under data.data_dir; a second call only memory-maps the token files.
  `checked`: what `preflight` returned for this config (else it runs here). `tokenizer_file`:
  a tokenizer file to use instead of the config's (a resumed workdir's own copy:
  `workdir.Workdir.resume_tokenizer`); its token streams are made here where missing.
  """
  data_config_lib.check_typed(data_config, 'data.load')
  source = registry.lookup(data_config.dataset)
  if source is not None and source.generated:  # nothing to prepare: generated on the fly
    return source.generator().load(data_config)
  if data_config.dataset.startswith(registry.NEEDLE_PREFIX):  # windows of a base corpus's text
    from efficient_lm.data import needle  # pylint: disable=g-import-not-at-top
    return needle.load(data_config, checked if checked is not _UNCHECKED
                       else preflight(data_config),
                       functools.partial(load, tokenizer_file=tokenizer_file))
  text_scan = checked if checked is not _UNCHECKED else preflight(data_config)
  root = os.path.abspath(os.path.expanduser(data_config.data_dir))
  try:
    files.check_writable(root)
  except OSError as e:
    raise ConfigError(f"data.data_dir={data_config.data_dir!r} is not a writable directory "
                      f"({type(e).__name__}: {e.strerror or e}); set data.data_dir to a directory "
                      'you can write') from e
  builder = make_builder(data_config, os.path.join(root, 'tfds'), text_scan)
  name = data_config.dataset
  info = builder.info
  features = info.features.keys() if hasattr(info.features, 'keys') else ()
  text_key = data_config.text_key
  require(text_key in features, 'data.text_key', text_key, f'is not a feature of {name}',
          f'use one of {sorted(features)}')
  train_split = info.splits['train'] if 'train' in info.splits else None
  if train_split is None or train_split.num_examples == 0:
    raise DataError(f'data.dataset={name!r} has no documents in its train split (prepared in '
                    f'{builder.data_dir}); check data.archive, or delete that directory to prepare '
                    'it again')
  corpus_id = {'name': name, 'version': str(builder.version),
               'splits': {s: [info.splits[s].num_examples, info.splits[s].num_bytes]
                          for s in sorted(info.splits)}}
  if text_scan is not None:  # the files' paths, sizes, mtimes and the fractions: one cache per folder state
    corpus_id['files'] = text_scan.cache_key
  tokenizer, key = cache.load_tokenizer(data_config, builder, corpus_id, root,
                                        tokenizer_file)
  splits = cache.token_streams(root, name, key, tokenizer, list(info.splits),
                               lambda split: cache.documents(builder, split, text_key))
  order = [s for s in ('train', 'validation', 'test') if s in splits]
  splits = {s: splits[s] for s in order + sorted(set(splits) - set(order))}
  identity = {'dataset': name, 'source': cache.key_of(corpus_id),
              'tokenizer_sha256': archives.sha256_of(tokenizer.model_path),
              'vocab_size': tokenizer.vocab_size}
  corpus = corpus_lib.Corpus(name=name, tokenizer=tokenizer, splits=splits,
                             seq_len=data_config.seq_len, batch_size=data_config.batch_size,
                             identity=identity, document_mask=data_config.document_mask)
  log.info('%r', corpus)
  return corpus
