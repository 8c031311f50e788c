"""Where every dataset is named once: what `data.dataset` may be, its splits, and how it is built.

A `Source` is a built-in dataset (`shakespeare`, `wikitext103`, `python_code`: a TFDS builder on
an archive) or a family addressed by a prefix (`tfds:<name>`, any TFDS text dataset; `text:<glob>`,
your own files; `hf:<path>`, what `datasets.load_dataset` loads; `mqar:<options>`, a generated recall
task with no text; `needle:<options>`, needles planted in a text dataset's windows). `lookup(dataset)`
finds it (`source(dataset)`: or says what is accepted). Each entry carries everything the rest of
the library asks of its kind (its checks, TFDS builder, own corpus loader, options, whether it has
text and what long-context tasks take from it), so nothing outside this module tests a dataset's
prefix. Hooks are imported only when used, so validating a config stays cheap.

Adding a source: write its module in efficient_lm/data (its preflight, builder or loader, and for
a `prefix:key=value,...` source its options dataclass, `source_options`), add one `Source` to
`SOURCES`, and document it in docs/data.md.
"""

import dataclasses
import importlib
from typing import Callable

from efficient_lm.config.errors import ConfigError

TFDS_PREFIX = 'tfds:'
TEXT_PREFIX = 'text:'
HF_PREFIX = 'hf:'
MQAR_PREFIX = 'mqar:'
NEEDLE_PREFIX = 'needle:'


def _named(target: str):
  """The object 'module:name' names in efficient_lm.data (imported now, not before)."""
  module, _, name = target.partition(':')
  return getattr(importlib.import_module(f'efficient_lm.data.{module}'), name)


@dataclasses.dataclass(frozen=True)
class Source:
  """One kind of `data.dataset`: what it is called, and everything the rest of the library asks of
  it (how it is checked, prepared and loaded, its options, what the long-context tasks take from
  it). The hooks are 'module:name' strings of efficient_lm.data, imported on first use."""
  name: str                          # the dataset name, or the prefix with its ':'
  example: str                       # what to write in the config, for messages
  splits: Callable | None = None     # DataConfig -> the splits (None: known once prepared)
  builder: str = ''                  # the TFDS builder: with takes_archive a builder class on an
                                     # archive ('module:Class'), else a function (checked,
                                     # tfds_dir, data_config) -> an (unprepared) builder
  takes_archive: bool = False        # `data.archive` / `data.archive_sha256` apply
  generated: str = ''                # 'module': a source with no text (no TFDS, no tokenizer to
                                     # train): its `validate(data_config)` and `load(data_config)`
                                     # (a `DataConfig`)
  options: bool = False              # the prefix alone is a dataset (every option has a default)
  checks: str = ''                   # its preflight (data_config, read, base_preflight) -> what
                                     # `load` needs: before anything compiles; '' = none
  loader: str = ''                   # a corpus it builds itself (data_config, checked, base_load):
                                     # needles planted in a base corpus's windows
  parser: str = ''                   # 'prefix:key=value,...' -> its typed options (source_options)
  planted: bool = False              # needles planted in a base corpus's text: a long-context task
                                     # takes the base's text as haystack and the task's key words

  @property
  def is_prefix(self) -> bool:
    return self.name.endswith(':')

  @property
  def has_text(self) -> bool:
    """Whether it is text (a held-out split to score, a haystack), not generated tokens."""
    return not self.generated

  @property
  def builds_corpus(self) -> bool:
    """Whether `load` gives its corpus (not the text pipeline: TFDS, tokenizer, token streams)."""
    return bool(self.generated or self.loader)

  def builder_class(self):
    return _named(self.builder)

  def generator(self):
    """The module of a generated source (`validate`, `load`)."""
    return importlib.import_module(f'efficient_lm.data.{self.generated}')

  def parse(self, dataset: str):
    """The typed options `dataset` names (an options source: mqar, needle); ConfigError if bad."""
    if not self.parser:
      raise ConfigError(f'data.dataset={dataset!r} takes no options')
    return _named(self.parser)(dataset)

  def preflight(self, data_config, read: bool, base_preflight):
    """Its checks that read no more than the config names (`pipeline.preflight`); None if none."""
    return _named(self.checks)(data_config, read, base_preflight) if self.checks else None

  def make_builder(self, data_config, tfds_dir: str, checked):
    """Its TFDS builder under `tfds_dir` (not prepared yet): a text source's."""
    if self.takes_archive:
      return self.builder_class()(data_dir=tfds_dir, file_format='array_record',
                                  archive=data_config.archive,
                                  archive_sha256=data_config.archive_sha256)
    return _named(self.builder)(checked, tfds_dir, data_config)

  def load(self, data_config, checked, base_load):
    """The corpus of a source that `builds_corpus`: a generated task's, or needles planted in the
    corpus `base_load` (the pipeline's `load`) gives of its base."""
    if self.generated:
      return self.generator().load(data_config)
    return _named(self.loader)(data_config, checked, base_load)


def _text_splits(data_config) -> tuple[str, ...]:
  held_out = [s for s in ('validation', 'test') if getattr(data_config, f'{s}_fraction') > 0]
  return ('train', *held_out)


SOURCES = {source.name: source for source in (
    Source('shakespeare', 'shakespeare', builder='shakespeare:Shakespeare', takes_archive=True,
           splits=lambda cfg: ('train', 'validation', 'test', 'test_milton')),
    Source('wikitext103', 'wikitext103', builder='wikitext103:Wikitext103', takes_archive=True,
           splits=lambda cfg: ('train', 'validation', 'test')),
    Source('python_code', 'python_code', builder='python_code:PythonCode', takes_archive=True,
           splits=lambda cfg: ('train', 'validation', 'test')),
    Source(TFDS_PREFIX, 'tfds:<name> (e.g. tfds:pg19)', builder='text_builder:tfds_builder'),
    Source(TEXT_PREFIX, "text:<glob> for your own files (e.g. 'text:~/notes/**/*.txt')",
           splits=_text_splits, checks='text_files:preflight', builder='text_files:make_builder'),
    Source(HF_PREFIX, 'hf:<path> (a folder of data files or of save_to_disk, or a hub name in the '
           "local cache; 'hf:<path>:<config_name>' picks a config)",
           checks='hf_datasets:preflight', builder='hf_datasets:make_builder'),
    Source(MQAR_PREFIX, 'mqar:<options> (distance-controlled recall, e.g. mqar:queries=16)',
           splits=lambda cfg: ('train', 'validation', 'test'), generated='mqar', parser='mqar:parse'),
    Source(NEEDLE_PREFIX, 'needle:<options> (needles in a text dataset, e.g. '
           'needle:base=shakespeare,needles=2)', takes_archive=True, options=True,
           splits=lambda cfg: _named('needle:known_splits')(cfg), checks='needle:preflight',
           loader='needle:load', parser='needle:parse', planted=True),
)}
BUILT_IN = tuple(name for name, source in SOURCES.items() if not source.is_prefix)


def lookup(dataset) -> Source | None:
  """The source `dataset` names (a built-in name, or a prefix with something after it), or None."""
  if not isinstance(dataset, str):
    return None
  if dataset in SOURCES and not SOURCES[dataset].is_prefix:
    return SOURCES[dataset]
  for source in SOURCES.values():
    if source.is_prefix and dataset.startswith(source.name) and (
        dataset[len(source.name):].strip() or source.generated or source.options):  # 'mqar:' alone
      return source
  return None


def source(dataset) -> Source:
  """The source `dataset` names (`lookup`); a ConfigError naming data.dataset and the accepted
  values when it names none."""
  found = lookup(dataset)
  if found is None:
    raise ConfigError(f'data.dataset={dataset!r} is not a known dataset; use one of {known()}')
  return found


def known() -> str:
  """The accepted values, for an error message."""
  families = [source.example for source in SOURCES.values() if source.is_prefix]
  return f"{', '.join(BUILT_IN)} or {', or '.join(families)}"
