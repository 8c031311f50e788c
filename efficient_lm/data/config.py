"""The typed data section checked against the dataset's registry and the disk (`validate`: what
`DataSource`'s rules declare, each field's own checks having run as the section was built), and
the errors the data raises. Every function here takes the typed section (`DataConfig`, a
`RunConfig`'s `data`), never the config's mapping (`check_typed`).

Cheap: no I/O beyond `os.path` checks (and reading `data.tokenizer`'s file, whose size sets
`data.vocab_size`) and no heavy import, so a bad config fails in well under a second, before
anything is prepared.
"""

import dataclasses
import os

from efficient_lm.config import fields as tc

from efficient_lm.data import hooks
from efficient_lm.data import registry
from efficient_lm.data import tokenizer as tok
from efficient_lm.data.errors import DataError
from efficient_lm.config.data import DataConfig
from efficient_lm.config.errors import ConfigError

TFDS_PREFIX, TEXT_PREFIX = registry.TFDS_PREFIX, registry.TEXT_PREFIX
MIN_VOCAB_SIZE = 260  # the tokenizer's reserved pieces: <pad>, <unk>, </s>, '\n', 256 bytes


def check_typed(data_config, what: str) -> None:
  """Raises the TypeError of a data function `what` handed anything but the typed section
  `validate` returns (the config's mapping, most often), naming the fix."""
  if not isinstance(data_config, DataConfig):
    raise TypeError(f'{what} takes the typed data section (a RunConfig\'s data: '
                    f'config.run.build(...).data), not {type(data_config).__name__}')


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
  source: registry.Source | None = None

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
      _rule('vocab_size', lambda s: s.data.vocab_size >= MIN_VOCAB_SIZE,
            f'is below the {MIN_VOCAB_SIZE} pieces the tokenizer reserves (specials, newline, 256 '
            'bytes)', f'set data.vocab_size >= {MIN_VOCAB_SIZE} (8192 is the default)',
            when=lambda s: not s.data.tokenizer and not s.source.generated),
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
  if source is not None and source.planted:  # needles in a base corpus: its splits
    return known_splits(hooks.base_config(data_config))
  return None if source is None or source.splits is None else source.splits(data_config)


def validate(data_config: DataConfig) -> DataConfig:
  """Raises ConfigError naming the first `config.data` field the dataset's registry or the disk
  refuses (`DataSource`'s rules; a generated dataset's options by its source). Returns the section
  as the run uses it: a new `DataConfig` whose `vocab_size` is a given `data.tokenizer`'s size."""
  check_typed(data_config, 'data.validate')
  source = DataSource(data=data_config, source=registry.lookup(data_config.dataset)).source
  if data_config.tokenizer:
    data_config = dataclasses.replace(data_config, vocab_size=tok.open_given(data_config).vocab_size)
  if source.generated:  # no text: the source checks its own options
    hooks.generator(source).validate(data_config)
  return data_config
