"""Data sources as registry entries (`data.registry`) and their one option parser
(`data.source_options`): what each entry says, and no prefix tested outside the registry."""

import dataclasses
import pathlib
import re

import pytest

from efficient_lm.config.data import DataConfig
from efficient_lm.config.errors import ConfigError
from efficient_lm.data import hooks
from efficient_lm.data import needle
from efficient_lm.data import registry
from efficient_lm.data import source_options
from efficient_lm.data.mqar import task as mqar_task

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'efficient_lm'


def test_each_kind_is_one_entry():
  kinds = {d: registry.source(d) for d in ('shakespeare', 'tfds:pg19', 'text:~/x/*.txt',
                                           'hf:owner/name', 'mqar:', 'needle:')}
  assert [s.has_text for s in kinds.values()] == [True, True, True, True, False, True]
  assert [bool(s.planted) for s in kinds.values()] == [False] * 5 + [True]
  assert [s.builds_corpus for s in kinds.values()] == [False] * 4 + [True, True]
  assert hooks.parse('mqar:pairs=8,queries=2') == mqar_task.parse('mqar:pairs=8,queries=2')
  assert hooks.parse('needle:keys=5').key_words == needle.KEY_WORDS[:5]
  assert hooks.base_config(DataConfig(dataset='needle:base=wikitext103')).dataset == 'wikitext103'
  with pytest.raises(ConfigError, match=r"^data\.dataset='text:~/x/\*\.txt' takes no options$"):
    hooks.parse('text:~/x/*.txt')
  with pytest.raises(ConfigError, match=r"^data\.dataset='nope' is not a known dataset; use one of "
                     r"shakespeare, wikitext103, python_code or tfds:<name>"):
    registry.source('nope')
  # The built-ins and tfds: need no check before preparing; text: does (its glob matches nothing).
  assert hooks.preflight(DataConfig(), True, None) is None
  with pytest.raises(ConfigError, match=r'matches no file'):
    hooks.preflight(DataConfig(dataset='text:/nonexistent/**/*.txt'), True, None)


def test_the_registry_names_its_hooks_and_imports_none():
  """Every hook the registry names exists (`data.hooks` imports it on first use); the registry
  itself imports no source module, so a source may import it without a circle
  (tests/test_imports.py adds the hooks' imports to the graph)."""
  for source in registry.SOURCES.values():
    for field in hooks.HOOK_FIELDS:
      target = getattr(source, field)
      if target and ':' in target:
        assert callable(hooks._named(target)), (source.name, field, target)  # pylint: disable=protected-access
      elif target:
        assert hooks.generator(source).load, (source.name, field)
  assert 'importlib' not in (PACKAGE / 'data' / 'registry.py').read_text()


def test_no_prefix_dispatch_outside_the_registry():
  """Callers ask the registry what a dataset is: no `startswith('mqar:')` (or any source prefix)
  outside data/registry.py and the source's own option parser."""
  prefixes = '|'.join(re.escape(p) for p in ('tfds:', 'text:', 'hf:', 'mqar:', 'needle:'))
  pattern = re.compile(rf"""startswith\(\s*(['"]({prefixes})['"]|(registry\.)?(TFDS_|TEXT_|HF_|MQAR_|NEEDLE_)?PREFIX\))""")
  allowed = {'data/registry.py', 'data/source_options.py'}
  found = [f'{p.relative_to(PACKAGE)}:{i}' for p in PACKAGE.rglob('*.py')
           for i, line in enumerate(p.read_text().splitlines(), 1)
           if pattern.search(line) and str(p.relative_to(PACKAGE)) not in allowed]
  assert not found, found


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Toy:
  size: int = source_options.option(derive=lambda o, run: run.get('size') or 4, least=2,
                                    doc='how many')
  twice: int = source_options.option(derive=lambda o, run: 2 * o['size'], doc='derived')
  name: str = source_options.option('x', in_spec=False, doc='left out of the spec at x')


def test_one_parser_declared_options():
  parse = lambda d, **run: source_options.parse(_Toy, 'toy:', d, what='a toy', example='toy:size=3',
                                                run=run)
  assert parse('toy:') == _Toy(size=4, twice=8, name='x')
  assert parse('toy:', size=6) == _Toy(size=6, twice=12, name='x')  # the run's default
  assert parse(' toy: name = y , size=3,'.strip()) == _Toy(size=3, twice=6, name='y')
  assert source_options.spec(parse('toy:size=3'), 'toy:') == 'toy:size=3,twice=6'
  assert source_options.spec(parse('toy:name=z'), 'toy:') == 'toy:size=4,twice=8,name=z'
  assert source_options.describe(_Toy)[0] == 'size (int, default derived): how many'
  for dataset, message in (
      ('toy:sise=3', r"^data\.dataset='toy:sise=3' has an unknown toy option 'sise'; did you mean "
                     r"size\? the options are size, twice, name$"),
      ('toy:size=1', r"^data\.dataset: toy:size=1 must be at least 2; set size>=2$"),
      ('toy:size=a', r"^data\.dataset: toy:size='a' must be an integer; set size to a whole number >= 2$"),
      ('toy:name', r"^data\.dataset: toy:name='' has no value; write name=<value>$"),
      ('toy:size=3,size=4', r"^data\.dataset: toy:size='4' is given twice \(also size=3\); give size once$"),
      ('mqar:', r"^data\.dataset='mqar:' is not a toy; write toy:<options>, e\.g\. 'toy:size=3'")):
    with pytest.raises(ConfigError, match=message):
      parse(dataset)
