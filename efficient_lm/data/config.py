"""`config.data` checked (`validate`: the typed section, `data_config.DataConfig`, whose fields
declare their defaults and checks; then what needs the dataset's registry or the disk, declared
as `DataSource`'s rules), and the errors the data raises. Every function here but `validate`
takes the typed section `validate` returns, never the config's mapping (`check_typed`).

Cheap: no I/O beyond `os.path` checks (and reading `data.tokenizer`'s file, whose size sets
`data.vocab_size`) and no heavy import, so a bad config fails in well under a second, before
anything is prepared.
"""

import dataclasses
import os
from typing import Any

from efficient_lm.config import fields as tc

from efficient_lm.data import registry
from efficient_lm.data.errors import DataError
from efficient_lm.config.data import DataConfig
from efficient_lm.config.errors import ConfigError, require

TFDS_PREFIX, TEXT_PREFIX = registry.TFDS_PREFIX, registry.TEXT_PREFIX
MIN_VOCAB_SIZE = 260  # the tokenizer's reserved pieces: <pad>, <unk>, </s>, '\n', 256 bytes


def check_typed(data_config, what: str) -> None:
  """Raises the TypeError of a data function `what` handed anything but the typed section
  `validate` returns (the config's mapping, most often), naming the fix."""
  if not isinstance(data_config, DataConfig):
    raise TypeError(f'{what} takes the typed data section (data.validate(config.data) or '
                    f'training.prepare.prepare(config).data), not {type(data_config).__name__}')


def open_given(data_config: DataConfig):
  """`data.tokenizer`'s tokenizer, opened once per file state (`tokenizer.given_tokenizer`); a
  ConfigError naming the field when it cannot be used."""
  from efficient_lm.data import tokenizer as tok  # pylint: disable=g-import-not-at-top
  path = data_config.tokenizer
  try:
    return tok.given_tokenizer(path, data_config.separator_token)
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


def _tokenizer_size(typed: DataConfig, section, path: str) -> int:
  """`data.tokenizer`'s size, which sets `data.vocab_size` (in the config's `section` too, when
  there is one: `model.vocab_size` follows); a `--config.data.vocab_size` that disagrees is a
  ConfigError."""
  tokenizer = open_given(typed)
  given = None if section is None else _given_on_command_line(section, 'vocab_size')
  if given is not None and given != tokenizer.vocab_size:
    raise ConfigError(f'--config.data.vocab_size={given!r} disagrees with data.tokenizer={path!r}, '
                      f'which has {tokenizer.vocab_size} ids; drop --config.data.vocab_size (the '
                      f'tokenizer sets it) or give {tokenizer.vocab_size}')
  if section is not None:
    section['vocab_size'] = tokenizer.vocab_size
  return tokenizer.vocab_size


def _is_file(path: str) -> bool:
  return os.path.isfile(os.path.expanduser(path))


def _rule(field: str, ok, requirement: str, fix: str, when=None) -> tc.Rule:
  """A rule of `DataSource` on `data.<field>` (its `when`, if any, after a known dataset)."""
  return tc.Rule(f'data.{field}', ok, requirement, fix, value=lambda s: getattr(s.data, field),
                 when=None if when is None else lambda s: s.source is not None and when(s),
                 derive=lambda s: {'known': registry.known(), 'built_in': ', '.join(registry.BUILT_IN)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSource(tc.Section):
  """The typed data section with its dataset's registry entry (`source`, None for an unknown
  name): the rules that need the registry or the disk, declared and run in order as it is
  constructed (`validate`)."""
  SECTION = 'data'
  data: DataConfig
  source: Any = None

  RULES = (
      _rule('dataset', lambda s: s.source is not None, 'is not a known dataset', 'use one of {known}'),
      _rule('data_dir', lambda s: not os.path.exists(os.path.expanduser(s.data.data_dir)) or
            os.path.isdir(os.path.expanduser(s.data.data_dir)), 'exists and is not a directory',
            'point data.data_dir at a directory'),
      _rule('tokenizer', lambda s: not s.source.generated, 'does not apply to the generated '
            'dataset {data.dataset!r} (it has its own ids)', "set data.tokenizer to ''",
            when=lambda s: s.data.tokenizer),
      _rule('tokenizer', lambda s: _is_file(s.data.tokenizer), 'is not an existing file',
            "point it at a sentencepiece .model or a Hugging Face tokenizer.json, or '' to train "
            'one', when=lambda s: s.data.tokenizer),
      _rule('archive', lambda s: s.source.takes_archive, 'is only used by the {built_in} datasets',
            "set data.archive to '' for {data.dataset}",
            when=lambda s: s.data.archive and not s.source.generated),
      _rule('archive', lambda s: _is_file(s.data.archive), 'is not an existing file',
            "fix the path, or set data.archive to '' to download",
            when=lambda s: s.data.archive and not s.source.generated),
  )


def has_document_ids(data_config: DataConfig) -> bool:
  """Whether the batches carry `segment_ids`: `data.document_mask` on a corpus of documents (a
  generated task's sequences are one document each)."""
  check_typed(data_config, 'data.has_document_ids')
  source = registry.lookup(data_config.dataset)
  return data_config.document_mask and not (source is not None and source.generated)


def known_splits(data_config: DataConfig) -> tuple[str, ...] | None:
  """The splits `config.data` will have, known without preparing anything; None when only the
  prepared data can say (a tfds:<name> dataset). A text: split with a fraction of 0 is not made."""
  check_typed(data_config, 'data.known_splits')
  source = registry.lookup(data_config.dataset)
  return None if source is None or source.splits is None else source.splits(data_config)


def validate(data_config, section=None) -> DataConfig:
  """Raises ConfigError naming the first bad `config.data` field: the declared checks of
  `DataConfig` (a field the section lacks takes its default; a `DataConfig` as it is), then
  `DataSource`'s rules (what needs the dataset's registry or the disk). Returns the typed section
  (`data.vocab_size` a given tokenizer's, also set in the config's data section: `data_config`
  if it is one, else `section`)."""
  typed = data_config if isinstance(data_config, DataConfig) else DataConfig.from_mapping(data_config)
  section = data_config if section is None and typed is not data_config else section
  source = DataSource(data=typed, source=registry.lookup(typed.dataset)).source
  if typed.tokenizer:
    typed = dataclasses.replace(typed, vocab_size=_tokenizer_size(typed, section, typed.tokenizer))
  if source.generated:  # no text: the source checks its own options
    source.generator().validate(typed)
    return typed
  require(typed.tokenizer or typed.vocab_size >= MIN_VOCAB_SIZE, 'data.vocab_size', typed.vocab_size,
          f'is below the {MIN_VOCAB_SIZE} pieces the tokenizer reserves (specials, newline, 256 bytes)',
          f'set data.vocab_size >= {MIN_VOCAB_SIZE} (8192 is the default)')
  return typed
