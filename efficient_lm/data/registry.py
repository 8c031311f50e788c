"""Where every dataset is named once: what `data.dataset` may be, its splits, and how it is built.

A `Source` is a built-in dataset (`shakespeare`, `wikitext103`, `python_code`: a TFDS builder on
an archive) or a family addressed by a prefix (`tfds:<name>`, any TFDS text dataset; `text:<glob>`,
your own files; `hf:<path>`, what `datasets.load_dataset` loads; `mqar:<options>`, a generated recall
task with no text; `needle:<options>`, needles planted in a text dataset's windows). `lookup(dataset)`
finds it. Builders are imported only when used, so validating a config stays cheap.
"""

import dataclasses
import importlib
from typing import Callable

TFDS_PREFIX = 'tfds:'
TEXT_PREFIX = 'text:'
HF_PREFIX = 'hf:'
MQAR_PREFIX = 'mqar:'
NEEDLE_PREFIX = 'needle:'


@dataclasses.dataclass(frozen=True)
class Source:
  """One kind of `data.dataset`."""
  name: str                          # the dataset name, or the prefix with its ':'
  example: str                       # what to write in the config, for messages
  splits: Callable | None = None     # DataConfig -> the splits (None: known once prepared)
  builder: str = ''                  # 'module:Class' of a built-in archive builder
  takes_archive: bool = False        # `data.archive` / `data.archive_sha256` apply
  generated: str = ''                # 'module': a source with no text (no TFDS, no tokenizer to
                                     # train): its `validate(data_config)` and `load(data_config)`
                                     # (a `DataConfig`)
  options: bool = False              # the prefix alone is a dataset (every option has a default)

  @property
  def is_prefix(self) -> bool:
    return self.name.endswith(':')

  def builder_class(self):
    module, _, cls = self.builder.partition(':')
    return getattr(importlib.import_module(f'efficient_lm.data.{module}'), cls)

  def generator(self):
    """The module of a generated source (`validate`, `load`)."""
    return importlib.import_module(f'efficient_lm.data.{self.generated}')


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
    Source(TFDS_PREFIX, 'tfds:<name> (e.g. tfds:pg19)'),
    Source(TEXT_PREFIX, "text:<glob> for your own files (e.g. 'text:~/notes/**/*.txt')",
           splits=_text_splits),
    Source(HF_PREFIX, 'hf:<path> (a folder of data files or of save_to_disk, or a hub name in the '
           "local cache; 'hf:<path>:<config_name>' picks a config)"),
    Source(MQAR_PREFIX, 'mqar:<options> (distance-controlled recall, e.g. mqar:queries=16)',
           splits=lambda cfg: ('train', 'validation', 'test'), generated='mqar'),
    Source(NEEDLE_PREFIX, 'needle:<options> (needles in a text dataset, e.g. '
           'needle:base=shakespeare,needles=2)', takes_archive=True, options=True,
           splits=lambda cfg: importlib.import_module('efficient_lm.data.needle').known_splits(cfg)),
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


def known() -> str:
  """The accepted values, for an error message."""
  families = [source.example for source in SOURCES.values() if source.is_prefix]
  return f"{', '.join(BUILT_IN)} or {', or '.join(families)}"
