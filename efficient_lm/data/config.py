"""`config.data`: its fields, their checks, and the errors the data raises.

Cheap: no I/O beyond `os.path` checks and no heavy import, so a bad config fails in well under a
second, before anything is prepared.
"""

import os
import re

import numpy as np

from efficient_lm.data import registry
from efficient_lm.validation import ConfigError, require, require_positive_int

TFDS_PREFIX, TEXT_PREFIX = registry.TFDS_PREFIX, registry.TEXT_PREFIX
FRACTION_DEFAULTS, fraction = registry.FRACTION_DEFAULTS, registry.fraction
MIN_VOCAB_SIZE = 260  # the tokenizer's reserved pieces: <pad>, <unk>, </s>, '\n', 256 bytes
FIELDS = ('dataset', 'seq_len', 'batch_size', 'vocab_size', 'data_dir', 'archive', 'archive_sha256',
          'text_key', 'tokenizer_train_bytes')


class DataError(ValueError):
  """The data itself (not a config field) cannot be used: an empty split, say."""


def document_mask(data_config) -> bool:
  """`data.document_mask`, or its default (True) if the config lacks it."""
  try:
    return data_config['document_mask']
  except (KeyError, AttributeError):
    return True


def has_document_ids(data_config) -> bool:
  """Whether the batches carry `segment_ids`: `data.document_mask` on a corpus of documents (a
  generated task's sequences are one document each)."""
  source = registry.lookup(data_config['dataset'])
  return document_mask(data_config) and not (source is not None and source.generated)


def _optional(cfg, name: str, default):
  """`cfg.<name>`, or `default` if the config lacks the field."""
  try:
    return cfg[name]
  except (KeyError, AttributeError):
    return default


def _field(cfg, name: str):
  try:
    return cfg[name]
  except (KeyError, AttributeError) as e:
    raise ConfigError(f'data.{name} is missing; add it to config.data') from e


def known_splits(data_config) -> tuple[str, ...] | None:
  """The splits `config.data` will have, known without preparing anything; None when only the
  prepared data can say (a tfds:<name> dataset). A text: split with a fraction of 0 is not made."""
  source = registry.lookup(data_config['dataset'])
  return None if source is None or source.splits is None else source.splits(data_config)


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def validate(data_config) -> None:
  """Raises ConfigError naming the first bad `config.data` field."""
  for name in FIELDS:
    _field(data_config, name)
  ds = data_config['dataset']
  source = registry.lookup(ds)
  require(source is not None, 'data.dataset', ds, 'is not a known dataset',
          f'use one of {registry.known()}')
  for name in ('seq_len', 'batch_size', 'vocab_size'):
    require_positive_int(f'data.{name}', data_config[name])
  data_dir = data_config['data_dir']
  require(isinstance(data_dir, str) and data_dir.strip() != '', 'data.data_dir', data_dir,
          'must be a directory path', 'set data.data_dir, e.g. ~/.cache/efficient_lm')
  expanded = os.path.expanduser(data_dir)
  require(not os.path.exists(expanded) or os.path.isdir(expanded), 'data.data_dir', data_dir,
          'exists and is not a directory', 'point data.data_dir at a directory')
  if source.generated:  # no text: the source checks its own options
    source.generator().validate(data_config)
    return
  fractions = [fraction(data_config, name) for name in FRACTION_DEFAULTS]
  for name, value in zip(FRACTION_DEFAULTS, fractions):
    require(isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
            and 0 <= value < 1, f'data.{name}', value, 'must be a number in [0, 1)',
            f'set data.{name} to e.g. {FRACTION_DEFAULTS[name]} (0 = no such split)')
  require(sum(fractions) < 1, 'data.validation_fraction', fractions[0],
          f'plus data.test_fraction={fractions[1]!r} must be below 1 (train keeps the rest)',
          'lower data.validation_fraction or data.test_fraction')
  vocab = data_config['vocab_size']
  require(vocab >= MIN_VOCAB_SIZE, 'data.vocab_size', vocab,
          f'is below the {MIN_VOCAB_SIZE} pieces the tokenizer reserves (specials, newline, 256 bytes)',
          f'set data.vocab_size >= {MIN_VOCAB_SIZE} (8192 is the default)')
  archive = data_config['archive']
  require(isinstance(archive, str), 'data.archive', archive, 'must be a string',
          "set data.archive to '' (download) or a local archive path")
  if archive:
    require(source.takes_archive, 'data.archive', archive,
            f'is only used by the {", ".join(registry.BUILT_IN)} datasets',
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
  if ds.startswith(registry.HF_PREFIX):
    allow = _optional(data_config, 'hf_allow_download', False)
    require(isinstance(allow, bool), 'data.hf_allow_download', allow, 'must be True or False',
            'set data.hf_allow_download=False (the local datasets cache only) or True')
  mask = document_mask(data_config)
  require(isinstance(mask, bool), 'data.document_mask', mask, 'must be True or False',
          'set data.document_mask=True (documents never attend into each other) or False')
  train_bytes = data_config['tokenizer_train_bytes']
  require(_is_int(train_bytes) and train_bytes >= 0, 'data.tokenizer_train_bytes', train_bytes,
          'must be an integer >= 0', 'set it to 0 (all the train split) or a byte budget')
