"""Where every dataset is named once: what `data.dataset` may be, its splits, and how it is built.

A `Source` is a built-in dataset (`shakespeare`, `wikitext103`, `python_code`: a TFDS builder on
an archive) or a family addressed by a prefix (`tfds:<name>`, any TFDS text dataset; `text:<glob>`,
your own files; `hf:<path>`, what `datasets.load_dataset` loads; `mqar:<options>`, a generated recall
task with no text; `needle:<options>`, needles planted in a text dataset's windows). `lookup(dataset)`
finds it (`source(dataset)`: or says what is accepted). Each entry carries everything the rest of
the library asks of its kind (its checks, TFDS builder, own corpus loader, options, whether it has
text and what long-context tasks take from it), so nothing outside this module tests a dataset's
prefix. The hooks are named here as 'module:name' strings and run by `data.hooks`, which imports
each on first use (validating a config stays cheap): this module imports none of them, so a source
module may import it (its prefix, `lookup`) without a circle.

Adding a source: write its module in efficient_lm/data (its preflight, builder or loader, and for
a `prefix:key=value,...` source its options dataclass, `source_options`), add one `Source` to
`SOURCES`, and document it in docs/data.md.
"""

import dataclasses
from typing import Callable

from efficient_lm.config.errors import ConfigError

TFDS_PREFIX = 'tfds:'
TEXT_PREFIX = 'text:'
HF_PREFIX = 'hf:'
MQAR_PREFIX = 'mqar:'
NEEDLE_PREFIX = 'needle:'


@dataclasses.dataclass(frozen=True)
class Source:
  """One kind of `data.dataset`: what it is called, and everything the rest of the library asks of
  it (how it is checked, prepared and loaded, its options, what the long-context tasks take from
  it). The hooks are 'module:name' strings of efficient_lm.data, run by `data.hooks`."""
  name: str                          # the dataset name, or the prefix with its ':'
  example: str                       # what to write in the config, for messages
  splits: Callable | None = None     # DataConfig -> the splits (None: known once prepared, or a
                                     # planted source's: its base's)
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
  planted: str = ''                  # needles planted in a base corpus's text: (data_config) -> the
                                     # base's data section (its splits are the base's; a long-context
                                     # task takes the base's text as haystack and the task's key words)

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
           checks='needle:preflight', loader='needle:load', parser='needle:parse',
           planted='needle:base_config'),
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
