"""The data cache: the tokenizer trained on a corpus, and each split's token stream.

Layout under `data.data_dir` (default ~/.cache/efficient_lm):

    tfds/                         prepared TFDS datasets (ArrayRecord) and their downloads
    tokenizers/<corpus>-<key>/    spm.model + settings.json, key = hash(corpus, tokenizer settings)
    tokens/<corpus>-<key>/        <split>.npy (int32 token stream) + <split>.json (bytes, documents,
                                  the key, the tokenizer's sha256 and separator id),
                                  key = `stream_key`: hash(corpus, tokenizer identity)

A split's stream is [eos, doc_0..., eos, doc_1..., eos, ...]. The streams are keyed by what they
are made of: the corpus's identity and the tokenizer's (its file's sha256 and its separator id),
for every source and every tokenizer, the library's own trained one and a `data.tokenizer` alike:
another tokenizer (even a swapped `spm.model` under the same settings) always tokenizes again.

How a source gets its key: it describes its documents in a JSON-able `corpus_id` (a name, a
version, the splits' sizes, its files' fingerprint: whatever changes when the documents may) and
calls `load_tokenizer(data_config, builder, corpus_id, root)` for the tokenizer and the key (a
resumed workdir's own tokenizer file, if given, over anything cached here), or
`stream_key(corpus_id, tokenizer)` for a tokenizer it has; `token_streams` then writes or reads
`tokens/<corpus>-<key>/`.

Every file appears atomically (written under a name of the process's own, then renamed), so
nothing half-written is ever read.
"""

import hashlib
import json
import logging
import os
import re
import time
from typing import Any

import numpy as np

from efficient_lm.runtime import files
from efficient_lm.runtime import progress
from efficient_lm.data import archives
from efficient_lm.data import corpus as corpus_lib
from efficient_lm.data import tokenizer as tok
from efficient_lm.data.config import ConfigError
from efficient_lm.data.tokenizer_protocol import FileTokenizer

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the token stream layout changes
_READ_CHUNK = 256  # records per data-source read / batched encode


def slug(name: str) -> str:
  return re.sub(r'[^A-Za-z0-9_.-]+', '_', name).strip('_')[:64]  # a directory name: bounded


def key_of(obj: Any) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def documents(builder, split: str, text_key: str):
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


def tokenizer_identity(tokenizer: FileTokenizer) -> dict:
  """What a tokenizer's token streams depend on: its file's sha256, its kind and its separator
  (end-of-document) id."""
  return {'sha256': archives.sha256_of(tokenizer.model_path),
          'kind': getattr(tokenizer, 'kind', 'sentencepiece'), 'separator_id': int(tokenizer.eos_id)}


def stream_key(corpus_id: dict, tokenizer: FileTokenizer) -> str:
  """The key of the token streams of the corpus `corpus_id` (any JSON-able description that
  changes whenever its documents may) tokenized by `tokenizer` (`tokenizer_identity`)."""
  return key_of({'corpus': corpus_id, 'tokenizer': tokenizer_identity(tokenizer),
                 'format': CACHE_FORMAT})


def write_stream(path: str, meta_path: str, tokenizer: FileTokenizer, documents, key: str = '') -> None:
  """Tokenizes `documents` into the packed stream at `path` (.npy), streaming through a raw file.

  `key` (`stream_key`) and the tokenizer's identity go into the meta file: a stream is read back
  only under its own key.
  Files appear atomically (written under a name of this process's own, then renamed), so
  processes that prepare the same cache at once only duplicate work, and a stop signal or a
  failure leaves neither a partial file nor a temporary one. A progress line every 20 s says how
  far it is.
  """
  unique = f'.{files.unique_suffix()}.tmp'
  raw_path, npy_tmp, meta_tmp = path + unique + '.raw', path + unique, meta_path + unique
  num_tokens = num_docs = num_bytes = 0
  eos = np.asarray([tokenizer.eos_id], dtype=np.int32).tobytes()
  what = f'tokenizing the {os.path.basename(path)[:-len(".npy")]} split'
  try:
    with progress.phase(what, status=lambda: f'{num_docs:,} documents, {num_tokens:,} tokens '
                        'written'), open(raw_path, 'wb') as raw:
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
                 'format': CACHE_FORMAT, 'key': key,
                 'tokenizer': tokenizer_identity(tokenizer) if tokenizer.model_path else None}, f)
    os.replace(meta_tmp, meta_path)
  finally:
    for leftover in (raw_path, npy_tmp, meta_tmp):
      if os.path.exists(leftover):
        os.remove(leftover)


def _remove_if_empty(directory: str) -> None:
  try:
    os.rmdir(directory)
  except OSError:  # not empty (or gone): kept
    pass


def _write_json(path: str, obj) -> None:
  """`path` holds `obj` as JSON, or is untouched: written beside, then renamed."""
  tmp = f'{path}.{files.unique_suffix()}.tmp'
  try:
    with open(tmp, 'w') as f:
      json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def load_tokenizer(data_config, builder, corpus_id: dict, root: str, tokenizer_file: str = ''):
  """(tokenizer, `stream_key`) for the corpus `corpus_id` of `builder` (`data_config`: the typed
  data section): `tokenizer_file` when given (a resumed workdir's own copy, whatever this cache
  holds), else `data.tokenizer` as it is when it names one, else the tokenizer trained on the
  train split (cached under `root`)."""
  if tokenizer_file:
    tokenizer = tok.given_tokenizer(tokenizer_file, data_config.separator_token)
    log.info('Using the tokenizer the run trained on: %s', tokenizer_file)
    return tokenizer, stream_key(corpus_id, tokenizer)
  if data_config.tokenizer:
    tokenizer = tok.open_given(data_config)
    log.info('Using the tokenizer %s (data.tokenizer)', tokenizer)
    return tokenizer, stream_key(corpus_id, tokenizer)
  tokenizer = _own_tokenizer(data_config, builder, corpus_id, root)
  return tokenizer, stream_key(corpus_id, tokenizer)


def _own_tokenizer(data_config, builder, corpus_id: dict, root: str):
  settings = {'vocab_size': data_config.vocab_size,
              'train_bytes': int(data_config.tokenizer_train_bytes),
              'trainer': tok.TRAINER_SETTINGS, 'text_key': data_config.text_key}
  key = key_of({'corpus': corpus_id, 'tokenizer': settings})
  directory = os.path.join(root, 'tokenizers', f'{slug(corpus_id["name"])}-{key}')
  model_path = os.path.join(directory, 'spm.model')
  if os.path.isfile(model_path):
    log.info('Loading tokenizer %s', model_path)
    try:
      return tok.Tokenizer(model_path, own=True)
    except Exception as e:  # pylint: disable=broad-except  (truncated or foreign file)
      log.warning('tokenizer %s is corrupt or unreadable (%s); training it again', model_path,
                  str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
  if 'train' not in builder.info.splits:
    raise ConfigError(f'data.dataset={data_config.dataset!r} has no train split to train the '
                      f'tokenizer on (splits: {sorted(builder.info.splits)}); use another dataset')
  split_bytes = int(builder.info.splits['train'].num_bytes or 0)
  cap = settings['train_bytes']
  fraction = min(1.0, cap / split_bytes) if cap and split_bytes else 1.0
  log.info('Training a %d-piece tokenizer on %s/train (%s)...', data_config.vocab_size,
           corpus_id['name'], f'{fraction:.0%} of each document, at most {cap:,} bytes '
           '(data.tokenizer_train_bytes)' if fraction < 1 else 'all of it')
  start = time.time()
  try:
    tokenizer = tok.Tokenizer.train(
        documents(builder, 'train', data_config.text_key), vocab_size=data_config.vocab_size,
        model_path=model_path, max_bytes=cap, fraction=fraction)
  except tok.VocabTooSmallError as e:
    raise ConfigError(f'data.vocab_size={data_config.vocab_size!r} is too small for '
                      f'{corpus_id["name"]}: {e}; raise data.vocab_size') from e
  finally:
    _remove_if_empty(directory)  # a stopped or failed training leaves no empty folder
  _write_json(os.path.join(directory, 'settings.json'), {'corpus': corpus_id, 'tokenizer': settings})
  log.info('Trained tokenizer (%d pieces) in %.1f s: %s', tokenizer.vocab_size,
               time.time() - start, model_path)
  return tokenizer


def token_streams(root: str, name: str, key: str, tokenizer: FileTokenizer, splits, documents_of) -> dict:
  """{split: `corpus.Split`} of `splits`, each tokenized once into `tokens/<name>-<key>/` (`key`:
  `stream_key`) and memory-mapped; `documents_of(split)` yields the split's documents (str). A
  stream whose meta file names another key (or none: written before keys were recorded) is
  tokenized again."""
  token_dir = os.path.join(root, 'tokens', f'{slug(name)}-{key}')
  os.makedirs(token_dir, exist_ok=True)
  out = {}
  for split in splits:
    path = os.path.join(token_dir, f'{slug(split)}.npy')
    meta_path = os.path.join(token_dir, f'{slug(split)}.json')
    meta = _read_meta(meta_path) if os.path.isfile(path) else None
    if meta is None or meta.get('key') != key:
      log.info('Tokenizing %s/%s...', name, split)
      start = time.time()
      write_stream(path, meta_path, tokenizer, documents_of(split), key)
      log.info('Tokenized %s/%s in %.1f s', name, split, time.time() - start)
      meta = _read_meta(meta_path)
    tokens = np.load(path, mmap_mode='r')
    if meta.get('format') != CACHE_FORMAT or len(tokens) != meta['stream_length']:
      raise ValueError(f'{path} does not match {meta_path}; delete {token_dir} to rebuild it')
    out[split] = corpus_lib.Split(tokens, meta['num_bytes'], meta['num_documents'])
  return out


def _read_meta(meta_path: str) -> dict | None:
  try:
    with open(meta_path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None
