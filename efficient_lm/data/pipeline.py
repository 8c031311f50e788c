"""Preparing and loading a corpus: `load(data_config)` -> `corpus.Corpus`, of the typed data
section (`data.validate(run.data)`, or the edge's `training.prepare.prepare(run)[0].data`).

    source (registry) -> TFDS builder (prepared once, ArrayRecord) -> tokenizer and token streams
    (cache) -> Corpus (its Grain iterators)

Everything is cached under `data.data_dir`; a second call only memory-maps the token files.
"""

import functools
import logging
import os
import time

from efficient_lm.runtime import files
from efficient_lm.data import archives
from efficient_lm.data import cache
from efficient_lm.data import config as data_config_lib
from efficient_lm.data import corpus as corpus_lib
from efficient_lm.data import hooks
from efficient_lm.data import registry
from efficient_lm.data import round_trip
from efficient_lm.data.config import DataError
from efficient_lm.config.data import DataConfig
from efficient_lm.config.errors import ConfigError, require

log = logging.getLogger(__name__)
EPOCHS_WARNING = 20  # more passes over the train windows than this: one warning line


def make_builder(data_config: DataConfig, tfds_dir: str, checked=None):
  """The prepared TFDS builder for `data.dataset` (prepares it on first use): the source's own
  (`registry`). `checked`: what its `preflight` found (for text:<glob>, the checked file list,
  made before anything is written)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  ds = data_config.dataset
  builder = hooks.make_builder(data_config, tfds_dir, checked)
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
  return hooks.preflight(data_config, read, preflight)


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
  source = registry.source(data_config.dataset)
  if source.builds_corpus:  # generated on the fly, or needles in the windows of a base corpus
    return hooks.load(data_config, checked if checked is not _UNCHECKED
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
  documents_of = lambda split: cache.documents(builder, split, text_key)
  splits = cache.token_streams(root, name, key, tokenizer, list(info.splits), documents_of)
  order = [s for s in ('train', 'validation', 'test') if s in splits]
  splits = {s: splits[s] for s in order + sorted(set(splits) - set(order))}
  token_dir = os.path.join(root, 'tokens', f'{cache.slug(name)}-{key}')  # (cache.token_streams')
  measured = round_trip.Measured(
      tokenizer, lambda split: os.path.join(token_dir, f'{cache.slug(split)}.round_trip.json'),
      lambda split: splits[split].tokens, documents_of)
  identity = {'dataset': name, 'source': cache.key_of(corpus_id),
              'tokenizer_sha256': archives.sha256_of(tokenizer.model_path),
              'vocab_size': tokenizer.vocab_size,
              'round_trip': _held_out_round_trip(data_config, measured, splits)}
  corpus = corpus_lib.Corpus(name=name, tokenizer=tokenizer, splits=splits,
                             seq_len=data_config.seq_len, batch_size=data_config.batch_size,
                             identity=identity, document_mask=data_config.document_mask,
                             round_trip=measured)
  log.info('%r', corpus)
  return corpus


def _held_out_round_trip(data_config: DataConfig, measured: round_trip.Measured,
                         splits: dict) -> dict:
  """Whether the tokenizer gives back each held-out split's documents ({split: the counts,
  without the example}: what data.json records), measured on first use and said in one line then
  (a warning on every load where it loses any; `round_trip`). The train split is measured only if
  it is scored (its size)."""
  records = {s: measured(s) for s in splits if s != 'train'}
  if not records:
    return {}
  name = (f'data.tokenizer={data_config.tokenizer!r}' if data_config.tokenizer else
          f'the tokenizer trained on {data_config.dataset}/train')
  level, line = round_trip.describe(records, name)
  if level > logging.INFO or measured.measured_now:
    log.log(level, '%s', line)
  return {s: {k: v for k, v in r.items() if k != 'example'} for s, r in records.items()}


def check_splits(corpus, data_config: DataConfig, eval_split: str, num_steps: int) -> str | None:
  """A run's splits, before any step: `eval_split` (`train.eval_split`) must be a split of the
  corpus (ConfigError), its train split must hold a batch of text (`check_train_split`); one
  warning line when `num_steps` (`train.num_steps`) pass over the train windows more than
  EPOCHS_WARNING times. Returns why the evaluation split is left out (it has no text: one warning
  line here; the run's eval figures are then null with this reason), else None."""
  if eval_split not in corpus.splits:
    raise ConfigError(f"train.eval_split={eval_split!r} is not a split of {data_config.dataset}; "
                      f"set train.eval_split to one of {', '.join(corpus.splits)}")
  check_train_split(corpus, data_config)
  windows = corpus.num_windows('train', drop_remainder=True, seq_len=data_config.seq_len)
  epochs = num_steps * data_config.batch_size / max(windows, 1)
  if epochs > EPOCHS_WARNING:
    log.warning('train.num_steps=%d x data.batch_size=%d windows is %.0f epochs of the %s train '
                'windows of %s: the model will memorize it (watch the eval loss); a larger corpus, '
                'fewer steps or a smaller model', num_steps, data_config.batch_size, epochs,
                f'{windows:,}', corpus.name)
  empty = corpus_lib.without_text(corpus, eval_split)
  if empty is None:
    return None
  log.warning('train.eval_split=%r of %s %s: it is left out (no evaluation runs; the eval figures '
              'are null, with the reason); give it text, or set train.eval_split to another split '
              '(%s)', eval_split, data_config.dataset, empty, ', '.join(corpus.splits))
  return f'not evaluated: the {eval_split} split {empty}'


def check_train_split(corpus, data_config: DataConfig) -> None:
  """DataError, one line naming the dataset, the split and the fix, when the train split of a text
  corpus holds no text or fewer tokens than one batch of windows (data.batch_size x
  (data.seq_len + 1)): a run on it would learn nothing of the data. Before any step."""
  if not isinstance(corpus, corpus_lib.Corpus):  # a generated task: its own checks
    return
  empty = corpus_lib.without_text(corpus, 'train')
  if empty:
    raise DataError(f'data.dataset={data_config.dataset!r}: its train split {empty}, nothing to '
                    'train on; give it some text (data.text_key names the field that holds it)')
  tokens, batch, seq_len = corpus.num_tokens('train'), data_config.batch_size, data_config.seq_len
  if tokens < batch * (seq_len + 1):
    raise DataError(f'data.dataset={data_config.dataset!r} has {tokens:,} tokens in its train '
                    f'split, fewer than one batch of windows (data.batch_size={batch} x '
                    f'(data.seq_len={seq_len} + 1) = {batch * (seq_len + 1):,}); give it more '
                    'text, or lower data.batch_size or data.seq_len')
