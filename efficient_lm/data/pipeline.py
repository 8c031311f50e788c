"""Corpus loading, token caching, packing into windows, and the Grain iterators.

Layout under `data.data_dir` (default ~/.cache/efficient_lm):

    tfds/                         prepared TFDS datasets (ArrayRecord) and their downloads
    tokenizers/<corpus>-<key>/    spm.model + settings.json, key = hash(corpus, tokenizer settings)
    tokens/<corpus>-<key>/        <split>.npy (int32 token stream) + <split>.json (bytes, documents)

Packing: a split's stream is [eos, doc_0..., eos, doc_1..., eos, ...]; window w is
stream[w*S : w*S + S + 1] (consecutive windows share one token), inputs = window[:-1],
targets = window[1:], so every token after the first is a target exactly once.
"""

import dataclasses
import hashlib
import json
import os
import re
import time
from typing import Any, Iterator

import logging
import numpy as np

from efficient_lm.validation import ConfigError, require, require_positive_int

log = logging.getLogger(__name__)

KNOWN_DATASETS = ('shakespeare', 'wikitext103')
# The splits each built-in dataset has (a tfds:<name> dataset's are known once it is prepared).
KNOWN_SPLITS = {'shakespeare': ('train', 'validation', 'test', 'test_milton'),
                'wikitext103': ('train', 'validation', 'test')}
TFDS_PREFIX = 'tfds:'
TEXT_PREFIX = 'text:'  # a folder of your own text files: efficient_lm/data/text_files.py
FRACTION_DEFAULTS = {'validation_fraction': 0.05, 'test_fraction': 0.05}  # text: held-out shares
MIN_VOCAB_SIZE = 260  # the tokenizer's reserved pieces: <pad>, <unk>, </s>, '\n', 256 bytes
FIELDS = ('dataset', 'seq_len', 'batch_size', 'vocab_size', 'data_dir', 'archive', 'archive_sha256',
          'text_key', 'tokenizer_train_bytes')
_CACHE_FORMAT = 1  # bump when the token stream layout changes
_READ_CHUNK = 256  # records per data-source read / batched encode


# ----------------------------------------------------------------------------------------------
# Config validation (cheap, no I/O beyond os.path checks).


def _field(cfg, name: str):
  try:
    return cfg[name]
  except (KeyError, AttributeError) as e:
    raise ConfigError(f'data.{name} is missing; add it to config.data') from e


def known_splits(data_config) -> tuple[str, ...] | None:
  """The splits `config.data` will have, known without preparing anything; None when only the
  prepared data can say (a tfds:<name> dataset). A text: split with a fraction of 0 is not made."""
  dataset = data_config['dataset']
  if isinstance(dataset, str) and dataset.startswith(TEXT_PREFIX):
    held_out = [s for s in ('validation', 'test') if fraction(data_config, f'{s}_fraction') > 0]
    return ('train', *held_out)
  return KNOWN_SPLITS.get(dataset)


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def validate(data_config) -> None:
  """Raises ConfigError naming the first bad `config.data` field."""
  for name in FIELDS:
    _field(data_config, name)
  ds = data_config['dataset']
  known = ', '.join(KNOWN_DATASETS)
  require(isinstance(ds, str) and (ds in KNOWN_DATASETS or any(
      ds.startswith(prefix) and ds[len(prefix):].strip() != '' for prefix in (TFDS_PREFIX, TEXT_PREFIX))),
          'data.dataset', ds, 'is not a known dataset',
          f'use one of {known} or tfds:<name> (e.g. tfds:pg19), or text:<glob> for your own files '
          "(e.g. 'text:~/notes/**/*.txt')")
  fractions = [fraction(data_config, name) for name in FRACTION_DEFAULTS]
  for name, value in zip(FRACTION_DEFAULTS, fractions):
    require(isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
            and 0 <= value < 1, f'data.{name}', value, 'must be a number in [0, 1)',
            f'set data.{name} to e.g. {FRACTION_DEFAULTS[name]} (0 = no such split)')
  require(sum(fractions) < 1, 'data.validation_fraction', fractions[0],
          f'plus data.test_fraction={fractions[1]!r} must be below 1 (train keeps the rest)',
          'lower data.validation_fraction or data.test_fraction')
  for name in ('seq_len', 'batch_size', 'vocab_size'):
    require_positive_int(f'data.{name}', data_config[name])
  vocab = data_config['vocab_size']
  require(vocab >= MIN_VOCAB_SIZE, 'data.vocab_size', vocab,
          f'is below the {MIN_VOCAB_SIZE} pieces the tokenizer reserves (specials, newline, 256 bytes)',
          f'set data.vocab_size >= {MIN_VOCAB_SIZE} (8192 is the default)')
  data_dir = data_config['data_dir']
  require(isinstance(data_dir, str) and data_dir.strip() != '', 'data.data_dir', data_dir,
          'must be a directory path', 'set data.data_dir, e.g. ~/.cache/efficient_lm')
  expanded = os.path.expanduser(data_dir)
  require(not os.path.exists(expanded) or os.path.isdir(expanded), 'data.data_dir', data_dir,
          'exists and is not a directory', 'point data.data_dir at a directory')
  archive = data_config['archive']
  require(isinstance(archive, str), 'data.archive', archive, 'must be a string',
          "set data.archive to '' (download) or a local archive path")
  if archive:
    require(ds in KNOWN_DATASETS, 'data.archive', archive, f'is only used by the {known} datasets',
            f"set data.archive to '' for {ds}")
    require(os.path.isfile(os.path.expanduser(archive)), 'data.archive', archive,
            'is not an existing file', "fix the path, or set data.archive to '' to download")
  sha = data_config['archive_sha256']
  require(isinstance(sha, str) and (sha == '' or re.fullmatch(r'[0-9a-fA-F]{64}', sha) is not None),
          'data.archive_sha256', sha, 'must be 64 hex digits or empty',
          "set data.archive_sha256 to '' (the official archive) or the archive's sha256")
  text_key = data_config['text_key']
  require(isinstance(text_key, str) and text_key != '', 'data.text_key', text_key,
          'must name the text feature', "set data.text_key, e.g. 'text'")
  train_bytes = data_config['tokenizer_train_bytes']
  require(_is_int(train_bytes) and train_bytes >= 0, 'data.tokenizer_train_bytes', train_bytes,
          'must be an integer >= 0', 'set it to 0 (all the train split) or a byte budget')


# ----------------------------------------------------------------------------------------------
# Preparation: TFDS builder, tokenizer, token streams.


def fraction(data_config, name: str):
  """`data.<name>` (validation_fraction, test_fraction), or its default if the config lacks it."""
  try:
    return data_config[name]
  except (KeyError, AttributeError):
    return FRACTION_DEFAULTS[name]


def _slug(name: str) -> str:
  return re.sub(r'[^A-Za-z0-9_.-]+', '_', name).strip('_')[:64]  # a directory name: bounded


def _key(obj: Any) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _make_builder(data_config, tfds_dir: str, text_scan=None):
  """The prepared TFDS builder for `data.dataset` (prepares it on first use).

  `text_scan`: for text:<glob>, the checked file list (text_files.scan), made before anything is written.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  ds = data_config['dataset']
  if text_scan is not None:
    from efficient_lm.data import text_files  # pylint: disable=g-import-not-at-top
    builder = text_files.make_builder(text_scan, tfds_dir)
  elif ds in KNOWN_DATASETS:
    if ds == 'shakespeare':
      from efficient_lm.data.shakespeare import Shakespeare as cls  # pylint: disable=g-import-not-at-top
    else:
      from efficient_lm.data.wikitext103 import Wikitext103 as cls  # pylint: disable=g-import-not-at-top
    builder = cls(data_dir=tfds_dir, file_format='array_record', archive=data_config['archive'],
                  archive_sha256=data_config['archive_sha256'])
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


def _documents(builder, split: str, text_key: str):
  """Yields the split's documents as str, in the data source's (deterministic) order."""
  source = builder.as_data_source(split=split)
  n = len(source)
  for start in range(0, n, _READ_CHUNK):
    indices = list(range(start, min(n, start + _READ_CHUNK)))
    records = source.__getitems__(indices) if hasattr(source, '__getitems__') else [source[i] for i in indices]
    for record in records:
      text = record[text_key]
      if isinstance(text, np.ndarray):
        text = text.item()
      yield text.decode('utf-8', errors='replace') if isinstance(text, bytes) else str(text)


def _write_stream(path: str, meta_path: str, tokenizer, documents) -> None:
  """Tokenizes `documents` into the packed stream at `path` (.npy), streaming through a raw file.

  Files appear atomically (written under a per-process name, then renamed), so processes
  that prepare the same cache at once only duplicate work.
  """
  unique = f'.{os.getpid()}.tmp'
  raw_path, npy_tmp, meta_tmp = path + unique + '.raw', path + unique, meta_path + unique
  num_tokens = num_docs = num_bytes = 0
  eos = np.asarray([tokenizer.eos_id], dtype=np.int32).tobytes()
  try:
    with open(raw_path, 'wb') as raw:
      raw.write(eos)
      num_tokens += 1
      chunk = []

      def flush():
        nonlocal num_tokens
        for ids in tokenizer.encode_batch(chunk):
          raw.write(ids.tobytes())
          raw.write(eos)
          num_tokens += len(ids) + 1
        chunk.clear()

      for text in documents:
        chunk.append(text)
        num_docs += 1
        num_bytes += len(text.encode('utf-8'))
        if len(chunk) >= _READ_CHUNK:
          flush()
      flush()
    source = np.memmap(raw_path, dtype=np.int32, mode='r', shape=(num_tokens,))
    out = np.lib.format.open_memmap(npy_tmp, mode='w+', dtype=np.int32, shape=(num_tokens,))
    step = 1 << 24
    for start in range(0, num_tokens, step):
      out[start:start + step] = source[start:start + step]
    out.flush()
    del out, source
    os.replace(npy_tmp, path)
    with open(meta_tmp, 'w') as f:
      json.dump({'num_bytes': num_bytes, 'num_documents': num_docs, 'stream_length': num_tokens,
                 'format': _CACHE_FORMAT}, f)
    os.replace(meta_tmp, meta_path)
  finally:
    for leftover in (raw_path, npy_tmp, meta_tmp):
      if os.path.exists(leftover):
        os.remove(leftover)


@dataclasses.dataclass(frozen=True)
class _Split:
  tokens: np.ndarray  # int32 stream, memory-mapped
  num_bytes: int
  num_documents: int


class DataError(ValueError):
  """The data itself (not a config field) cannot be used: an empty split, say."""


class Corpus:
  """A tokenized corpus: token streams per split, the tokenizer, and batch iterators."""

  def __init__(self, *, name: str, tokenizer, splits: dict[str, _Split], seq_len: int,
               batch_size: int):
    self.name = name
    self.tokenizer = tokenizer
    self._splits = splits
    self.seq_len = seq_len
    self.batch_size = batch_size

  @property
  def splits(self) -> tuple[str, ...]:
    return tuple(self._splits)

  def _split(self, split: str) -> _Split:
    if split not in self._splits:
      raise ValueError(f'{self.name} has no split {split!r}; it has {self.splits}')
    return self._splits[split]

  def tokens(self, split: str) -> np.ndarray:
    """The packed int32 stream: eos, then each document followed by eos."""
    return self._split(split).tokens

  def num_bytes(self, split: str) -> int:
    """UTF-8 bytes of the split's documents (the denominator of bits per byte)."""
    return self._split(split).num_bytes

  def num_documents(self, split: str) -> int:
    return self._split(split).num_documents

  def num_tokens(self, split: str) -> int:
    """Tokens scored over the split: each document's tokens plus its end-of-document token."""
    return len(self._split(split).tokens) - 1

  def num_windows(self, split: str, *, drop_remainder: bool = False, seq_len: int | None = None) -> int:
    seq_len = seq_len or self.seq_len
    n = self.num_tokens(split)
    return n // seq_len if drop_remainder else -(-n // seq_len)

  def train_iterator(self, batch_size: int | None = None, seed: int = 0, *, split: str = 'train',
                     seq_len: int | None = None, process_index: int = 0, process_count: int = 1):
    """Infinite grain DatasetIterator of shuffled training batches (see pipeline.train_dataset)."""
    return iter(self.train_dataset(batch_size, seed, split=split, seq_len=seq_len,
                                   process_index=process_index, process_count=process_count))

  def train_dataset(self, batch_size: int | None = None, seed: int = 0, *, split: str = 'train',
                    seq_len: int | None = None, process_index: int = 0, process_count: int = 1):
    """grain IterDataset: full windows of `split`, shuffled anew each epoch, batched.

    Each of `process_count` processes gets `batch_size` rows of the same global batch of
    batch_size * process_count windows (rows process_index*batch_size onwards). Partial last
    windows are dropped. The iterator's get_state() is a small JSON-able dict; set_state()
    on a fresh iterator from the same arguments resumes exactly.
    """
    import grain  # pylint: disable=g-import-not-at-top

    batch_size = batch_size or self.batch_size
    seq_len = seq_len or self.seq_len
    require_positive_int('batch_size', batch_size)
    require_positive_int('seq_len', seq_len)
    require(_is_int(seed) and 0 <= seed < 2**32, 'seed', seed, 'must be an integer in [0, 2**32)',
            'pass a non-negative 32-bit seed')
    require(_is_int(process_count) and process_count >= 1 and 0 <= process_index < process_count,
            'process_index', process_index, f'must be in [0, process_count={process_count})',
            'pass jax.process_index() and jax.process_count()')
    num_windows = self.num_windows(split, drop_remainder=True, seq_len=seq_len)
    require(num_windows > 0, 'data.seq_len', seq_len,
            f'is longer than the {split!r} split ({self.num_tokens(split)} tokens)', 'lower data.seq_len')
    gather = _TrainGather(self.tokens(split), seq_len, batch_size, process_index)
    ds = (grain.MapDataset.range(num_windows)
          .shuffle(seed=int(seed))
          .repeat(None)
          .batch(batch_size * process_count, drop_remainder=True)
          .map(gather))
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=8))

  def eval_batches(self, split: str, batch_size: int | None = None, *, seq_len: int | None = None,
                   process_index: int = 0, process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """Every target token of `split` exactly once, in order; padding has weight 0.

    Windows are taken in stream order; the last window and the last batch are padded with
    pad_id and weight 0. With several processes each gets its rows of every global batch
    (all processes yield the same number of batches).
    """
    batch_size = batch_size or self.batch_size
    seq_len = seq_len or self.seq_len
    require_positive_int('batch_size', batch_size)
    require_positive_int('seq_len', seq_len)
    tokens = self.tokens(split)
    n = len(tokens)
    pad = self.tokenizer.pad_id
    num_windows = self.num_windows(split, seq_len=seq_len)
    global_batch = batch_size * process_count
    offsets = np.arange(seq_len + 1, dtype=np.int64)
    for first in range(0, num_windows, global_batch):
      rows = first + process_index * batch_size + np.arange(batch_size, dtype=np.int64)
      positions = rows[:, None] * seq_len + offsets[None, :]
      valid = positions < n
      window = np.asarray(tokens[np.minimum(positions, n - 1)], dtype=np.int32)
      window = np.where(valid, window, pad).astype(np.int32)
      yield {
          'inputs': window[:, :-1],
          'targets': window[:, 1:],
          'weights': valid[:, 1:].astype(np.float32),
      }

  def __repr__(self) -> str:
    sizes = ', '.join(f'{s}={self.num_tokens(s)}' for s in self.splits)
    return f'Corpus({self.name}, vocab={self.tokenizer.vocab_size}, tokens: {sizes})'


class _TrainGather:
  """Maps a global batch of window indices to this process's (inputs, targets, weights)."""

  def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, process_index: int):
    self._tokens = tokens
    self._seq_len = seq_len
    self._rows = slice(process_index * batch_size, (process_index + 1) * batch_size)
    self._offsets = np.arange(seq_len + 1, dtype=np.int64)

  def __call__(self, window_ids) -> dict[str, np.ndarray]:
    starts = np.asarray(window_ids, dtype=np.int64)[self._rows] * self._seq_len
    window = np.asarray(self._tokens[starts[:, None] + self._offsets[None, :]], dtype=np.int32)
    return {
        'inputs': window[:, :-1],
        'targets': window[:, 1:],
        'weights': np.ones(window[:, 1:].shape, np.float32),
    }


def _load_tokenizer(data_config, builder, corpus_id: dict, root: str):
  from efficient_lm.data import tokenizer as tok  # pylint: disable=g-import-not-at-top

  settings = {'vocab_size': data_config['vocab_size'],
              'train_bytes': int(data_config['tokenizer_train_bytes']),
              'trainer': tok.TRAINER_SETTINGS, 'text_key': data_config['text_key']}
  key = _key({'corpus': corpus_id, 'tokenizer': settings})
  directory = os.path.join(root, 'tokenizers', f'{_slug(corpus_id["name"])}-{key}')
  model_path = os.path.join(directory, 'spm.model')
  if os.path.isfile(model_path):
    log.info('Loading tokenizer %s', model_path)
    try:
      return tok.Tokenizer(model_path), key
    except Exception as e:  # pylint: disable=broad-except  (truncated or foreign file)
      log.warning('tokenizer %s is corrupt or unreadable (%s); training it again', model_path,
                  str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
  if 'train' not in builder.info.splits:
    raise ConfigError(f'data.dataset={data_config["dataset"]!r} has no train split to train the '
                      f'tokenizer on (splits: {sorted(builder.info.splits)}); use another dataset')
  log.info('Training a %d-piece tokenizer on %s/train (%s)...', data_config['vocab_size'],
               corpus_id['name'], f'first {settings["train_bytes"]} bytes' if settings['train_bytes']
               else 'all of it')
  start = time.time()
  try:
    tokenizer = tok.Tokenizer.train(_documents(builder, 'train', data_config['text_key']),
                                    vocab_size=data_config['vocab_size'], model_path=model_path,
                                    max_bytes=settings['train_bytes'])
  except tok.VocabTooSmallError as e:
    raise ConfigError(f'data.vocab_size={data_config["vocab_size"]!r} is too small for '
                      f'{corpus_id["name"]}: {e}; raise data.vocab_size') from e
  with open(os.path.join(directory, 'settings.json'), 'w') as f:
    json.dump({'corpus': corpus_id, 'tokenizer': settings}, f, indent=1, sort_keys=True)
  log.info('Trained tokenizer (%d pieces) in %.1f s: %s', tokenizer.vocab_size,
               time.time() - start, model_path)
  return tokenizer, key


def load(data_config) -> Corpus:
  """Validates `config.data`, prepares the dataset, trains/loads the tokenizer, tokenizes splits.

  Everything is cached under data.data_dir; a second call only memory-maps the token files.
  """
  validate(data_config)
  text_scan = None
  if data_config['dataset'].startswith(TEXT_PREFIX):  # glob, binary and empty checks: nothing written yet
    from efficient_lm.data import text_files  # pylint: disable=g-import-not-at-top
    text_scan = text_files.scan(data_config['dataset'],
                                *(fraction(data_config, n) for n in FRACTION_DEFAULTS))
  root = os.path.abspath(os.path.expanduser(data_config['data_dir']))
  try:
    os.makedirs(root, exist_ok=True)
    probe = os.path.join(root, f'.write_test.{os.getpid()}')
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f"data.data_dir={data_config['data_dir']!r} is not a writable directory "
                      f"({type(e).__name__}: {e.strerror or e}); set data.data_dir to a directory "
                      'you can write') from e
  builder = _make_builder(data_config, os.path.join(root, 'tfds'), text_scan)
  name = data_config['dataset']
  info = builder.info
  features = info.features.keys() if hasattr(info.features, 'keys') else ()
  text_key = data_config['text_key']
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
  tokenizer, key = _load_tokenizer(data_config, builder, corpus_id, root)
  token_dir = os.path.join(root, 'tokens', f'{_slug(name)}-{key}')
  os.makedirs(token_dir, exist_ok=True)
  splits = {}
  for split in info.splits:
    path = os.path.join(token_dir, f'{_slug(split)}.npy')
    meta_path = os.path.join(token_dir, f'{_slug(split)}.json')
    if not (os.path.isfile(path) and os.path.isfile(meta_path)):
      log.info('Tokenizing %s/%s...', name, split)
      start = time.time()
      _write_stream(path, meta_path, tokenizer, _documents(builder, split, text_key))
      log.info('Tokenized %s/%s in %.1f s', name, split, time.time() - start)
    with open(meta_path) as f:
      meta = json.load(f)
    tokens = np.load(path, mmap_mode='r')
    if meta.get('format') != _CACHE_FORMAT or len(tokens) != meta['stream_length']:
      raise ValueError(f'{path} does not match {meta_path}; delete {token_dir} to rebuild it')
    splits[split] = _Split(tokens, meta['num_bytes'], meta['num_documents'])
  order = [s for s in ('train', 'validation', 'test') if s in splits]
  splits = {s: splits[s] for s in order + sorted(set(splits) - set(order))}
  corpus = Corpus(name=name, tokenizer=tokenizer, splits=splits,
                  seq_len=data_config['seq_len'], batch_size=data_config['batch_size'])
  log.info('%r', corpus)
  return corpus
