"""The registry's hooks, run: what a `data.dataset` does at each step (its options parsed, its
preflight, its TFDS builder, its corpus), dispatched on its `registry.Source`.

The registry names each hook as a 'module:name' string of efficient_lm.data; this module imports
the module on first use, so validating a config imports no TFDS, no tokenizer library and no
source it does not name. It sits above every source module (they may import the registry for
their prefix and `lookup`, never this module), and a hook that needs the pipeline's own step for
its base corpus (`preflight`, `load`) is handed it as an argument.
"""

import importlib

from efficient_lm.config.data import DataConfig
from efficient_lm.config.errors import ConfigError
from efficient_lm.data import registry

HOOK_FIELDS = ('builder', 'generated', 'checks', 'loader', 'parser', 'planted')  # the 'module[:name]' fields


def hook_modules(source: registry.Source) -> set[str]:
  """The modules of efficient_lm.data `source`'s hooks name (what this module may import for it)."""
  return {getattr(source, field).partition(':')[0] for field in HOOK_FIELDS
          if getattr(source, field)}


def _named(target: str):
  """The object 'module:name' names in efficient_lm.data (imported now, not before)."""
  module, _, name = target.partition(':')
  return getattr(importlib.import_module(f'efficient_lm.data.{module}'), name)


def generator(source: registry.Source):
  """The module of a generated source (its `validate(data_config)`, `load(data_config)`)."""
  return importlib.import_module(f'efficient_lm.data.{source.generated}')


def parse(dataset: str):
  """The typed options `dataset` names (an options source: mqar, needle); ConfigError if bad."""
  source = registry.source(dataset)
  if not source.parser:
    raise ConfigError(f'data.dataset={dataset!r} takes no options')
  return _named(source.parser)(dataset)


def base_config(data_config: DataConfig) -> DataConfig:
  """A planted source's base: the data section naming the corpus its haystacks are cut from."""
  return _named(registry.source(data_config.dataset).planted)(data_config)


def preflight(data_config: DataConfig, read: bool, base_preflight):
  """The source's checks that read no more than the config names (`pipeline.preflight`, handed in
  as `base_preflight` for a planted source's base); None if it has none."""
  source = registry.source(data_config.dataset)
  return _named(source.checks)(data_config, read, base_preflight) if source.checks else None


def make_builder(data_config: DataConfig, tfds_dir: str, checked):
  """The source's TFDS builder under `tfds_dir` (not prepared yet): a text source's."""
  source = registry.source(data_config.dataset)
  if source.takes_archive:
    return _named(source.builder)(data_dir=tfds_dir, file_format='array_record',
                                  archive=data_config.archive,
                                  archive_sha256=data_config.archive_sha256)
  return _named(source.builder)(checked, tfds_dir, data_config)


def load(data_config: DataConfig, checked, base_load):
  """The corpus of a source that `builds_corpus`: a generated task's, or needles planted in the
  corpus `base_load` (the pipeline's `load`) gives of its base."""
  source = registry.source(data_config.dataset)
  if source.generated:
    return generator(source).load(data_config)
  return _named(source.loader)(data_config, checked, base_load)
