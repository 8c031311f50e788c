"""`config.data`: its fields, their checks, and the errors the data raises.

Cheap: no I/O beyond `os.path` checks (and reading `data.tokenizer`'s file, whose size sets
`data.vocab_size`) and no heavy import, so a bad config fails in well under a second, before
anything is prepared.
"""

import os
import re

import numpy as np

from efficient_lm.data import registry
from efficient_lm.data.errors import DataError
from efficient_lm.validation import ConfigError, require, require_positive_int

TFDS_PREFIX, TEXT_PREFIX = registry.TFDS_PREFIX, registry.TEXT_PREFIX
FRACTION_DEFAULTS, fraction = registry.FRACTION_DEFAULTS, registry.fraction
MIN_VOCAB_SIZE = 260  # the tokenizer's reserved pieces: <pad>, <unk>, </s>, '\n', 256 bytes
FIELDS = ('dataset', 'seq_len', 'batch_size', 'vocab_size', 'data_dir', 'archive', 'archive_sha256',
          'text_key', 'tokenizer_train_bytes')


def document_mask(data_config) -> bool:
  """`data.document_mask`, or its default (True) if the config lacks it."""
  try:
    return data_config['document_mask']
  except (KeyError, AttributeError):
    return True


def _optional(data_config, name: str, default):
  try:
    return data_config[name]
  except (KeyError, AttributeError):
    return default


def tokenizer_path(data_config) -> str:
  """`data.tokenizer` ('' = train one on the corpus), or '' if the config lacks it."""
  return _optional(data_config, 'tokenizer', '')


def separator_token(data_config) -> str:
  """`data.separator_token` ('' = the tokenizer's eos / end-of-text), or '' if the config lacks it."""
  return _optional(data_config, 'separator_token', '')


def open_given(data_config):
  """`data.tokenizer`'s tokenizer, opened once per file state (`tokenizer.given_tokenizer`); a
  ConfigError naming the field when it cannot be used."""
  from efficient_lm.data import tokenizer as tok  # pylint: disable=g-import-not-at-top
  path = tokenizer_path(data_config)
  try:
    return tok.given_tokenizer(path, separator_token(data_config))
  except ValueError as e:
    raise ConfigError(f'data.tokenizer={path!r}: {e}') from None
  except OSError as e:
    raise ConfigError(f'data.tokenizer={path!r} cannot be read ({e.strerror or e}); point '
                      "data.tokenizer at a readable tokenizer file, or '' to train one") from None


def _given_on_command_line(data_config, field: str):
  """The value `--config.data.<field>=...` gave on the command line to the config `data_config`
  is part of (absl's config flag of `efficient_lm.main`), or None."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  try:
    holder = flags.FLAGS['config']
    config, overrides = holder.value, holder.override_values
  except (KeyError, AttributeError, flags.Error):
    return None
  try:
    if config is None or config.data is not data_config:
      return None
  except AttributeError:
    return None
  return overrides.get(f'data.{field}')


def _check_tokenizer(data_config, generated: bool) -> bool:
  """`data.tokenizer` and `data.separator_token`; with a tokenizer, `data.vocab_size` set to its
  size (`model.vocab_size` follows). Whether a tokenizer was given."""
  path, sep = tokenizer_path(data_config), separator_token(data_config)
  require(isinstance(path, str), 'data.tokenizer', path, 'must be a path or empty',
          "set data.tokenizer to a sentencepiece .model or a tokenizer.json, or '' to train one")
  require(isinstance(sep, str), 'data.separator_token', sep, 'must be a string',
          "set data.separator_token to one of the tokenizer's special tokens, or '' for its eos")
  if not path:
    require(sep == '', 'data.separator_token', sep, "only applies to a data.tokenizer of one's own",
            "set data.separator_token to '' (the trained tokenizer's eos separates documents)")
    return False
  require(not generated, 'data.tokenizer', path,
          f"does not apply to the generated dataset {data_config['dataset']!r} (it has its own ids)",
          "set data.tokenizer to ''")
  require(os.path.isfile(os.path.expanduser(path)), 'data.tokenizer', path,
          'is not an existing file',
          "point it at a sentencepiece .model or a Hugging Face tokenizer.json, or '' to train one")
  tokenizer = open_given(data_config)
  given = _given_on_command_line(data_config, 'vocab_size')
  if given is not None and given != tokenizer.vocab_size:
    raise ConfigError(f'--config.data.vocab_size={given!r} disagrees with data.tokenizer={path!r}, '
                      f'which has {tokenizer.vocab_size} ids; drop --config.data.vocab_size (the '
                      f'tokenizer sets it) or give {tokenizer.vocab_size}')
  data_config['vocab_size'] = tokenizer.vocab_size
  return True


def has_document_ids(data_config) -> bool:
  """Whether the batches carry `segment_ids`: `data.document_mask` on a corpus of documents (a
  generated task's sequences are one document each)."""
  source = registry.lookup(data_config['dataset'])
  return document_mask(data_config) and not (source is not None and source.generated)


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
  given = _check_tokenizer(data_config, bool(source.generated))
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
  require(given or vocab >= MIN_VOCAB_SIZE, 'data.vocab_size', vocab,
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
