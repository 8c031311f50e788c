"""The options of a source written `prefix:key=value,...` (`mqar:`, `needle:`): one parser for all.

A source declares its options as the fields of a frozen dataclass (its task), each made with
`option(...)`: its type (the field's annotation, `int` or `str`), its default (a value, or `derive`,
a function of the options resolved before it and of the run), what it accepts (`least`, `check`),
whether the canonical spec names it at its default, and a line of doc. `parse(cls, prefix, dataset)`
splits the string, refuses an unknown, empty or repeated key, converts each value to its field's
type, resolves the fields in their order (each checked as it is resolved, so a check may read the
fields before it) and builds the dataclass; `spec(task, prefix)` writes it back (`parse(spec) ==
task`). Every error is one ConfigError line that starts with `data.dataset` and names the key and
the fix (`fail`); an unknown key lists the allowed ones.
"""

import dataclasses
import difflib
import re
from typing import Any, Callable

from efficient_lm.config.errors import ConfigError

_INTEGER = re.compile(r'[+-]?[0-9]+')


def option(default: Any = dataclasses.MISSING, *, derive: Callable | None = None,
           least: int | None = None, check: Callable | None = None, in_spec: bool = True,
           doc: str = '') -> Any:
  """A field of a source's options. `derive(resolved, run)`: the default from the options resolved
  before it (a dict) and the run's values (`parse`'s `run`); `least`: the smallest integer allowed;
  `check(value, resolved)`: raises (`fail`) when the value cannot be used with those before it;
  `in_spec=False`: the canonical spec leaves it out at its default (an option added later, so the
  specs recorded before it stay the same)."""
  return dataclasses.field(default=default, metadata={
      'derive': derive, 'least': least, 'check': check, 'in_spec': in_spec, 'doc': doc})


def fail(prefix: str, name: str, value: Any, requirement: str, fix: str) -> None:
  """The one error of a bad option value: `data.dataset: <prefix><name>=<value> <requirement>; <fix>`."""
  raise ConfigError(f'data.dataset: {prefix}{name}={value!r} {requirement}; {fix}')


def names(cls) -> tuple[str, ...]:
  """The option names of `cls`, in their order (the canonical spec's)."""
  return tuple(f.name for f in dataclasses.fields(cls))


def describe(cls) -> list[str]:
  """One line per option of `cls`: its name, type, default and doc (for docs and --help)."""
  lines = []
  for f in dataclasses.fields(cls):
    default = ('derived' if f.metadata.get('derive') else
               repr(f.default) if f.default is not dataclasses.MISSING else 'required')
    lines.append(f'{f.name} ({f.type.__name__}, default {default}): {f.metadata.get("doc", "")}')
  return lines


def _split(prefix: str, dataset: str, types: dict[str, type], kind: str) -> dict[str, str]:
  """{key: its text} of 'prefix:key=value,...' (spaces around keys and values, empty items and a
  trailing comma allowed)."""
  given: dict[str, str] = {}
  allowed = tuple(types)
  for item in dataset[len(prefix):].split(','):
    if not item.strip():
      continue
    name, sep, text = (part.strip() for part in item.partition('='))
    if name not in allowed:
      close = difflib.get_close_matches(name, allowed, n=3, cutoff=0.5)
      hint = f"did you mean {' or '.join(close)}? " if close else ''
      raise ConfigError(f'data.dataset={dataset!r} has an unknown {kind} option {name!r}; {hint}'
                        f"the options are {', '.join(allowed)}")
    if not sep or not text:
      fail(prefix, name, text, 'has no value',
           f"write {name}=<{'integer' if types[name] is int else 'value'}>")
    if name in given:
      fail(prefix, name, text, f'is given twice (also {name}={given[name]})', f'give {name} once')
    given[name] = text
  return given


def parse(cls, prefix: str, dataset: Any, *, what: str, example: str, run: dict | None = None):
  """The options object of type `cls` that `dataset` ('prefix:key=value,...') names; `what` (e.g.
  'an MQAR task') and `example` say what to write when `dataset` is not of this prefix, `run` is
  handed to each `derive`. One-line ConfigError per bad option."""
  if not isinstance(dataset, str) or not dataset.startswith(prefix):
    raise ConfigError(f'data.dataset={dataset!r} is not {what}; write {prefix}<options>, e.g. '
                      f"{example!r} (or {prefix!r} for the defaults)")
  fields = dataclasses.fields(cls)
  given = _split(prefix, dataset, {f.name: f.type for f in fields}, prefix.rstrip(':'))
  resolved: dict[str, Any] = {}
  for f in fields:
    meta, least = f.metadata, f.metadata.get('least')
    if f.name in given:
      value = given[f.name]
      if f.type is int:
        if not _INTEGER.fullmatch(value):
          fail(prefix, f.name, value, 'must be an integer', f'set {f.name} to a whole number'
               + (f' >= {least}' if least is not None else ''))
        value = int(value)
    elif meta.get('derive') is not None:
      value = meta['derive'](resolved, run or {})
    else:
      value = f.default
    if least is not None and value < least:
      fail(prefix, f.name, value, f'must be at least {least}', f'set {f.name}>={least}')
    if meta.get('check') is not None:
      meta['check'](value, resolved)
    resolved[f.name] = value
  return cls(**resolved)


def spec(options, prefix: str) -> str:
  """The canonical dataset string of an options object: every option spelled out, but those
  declared `in_spec=False` at their default; `parse(spec(o)) == o`."""
  return prefix + ','.join(
      f'{f.name}={getattr(options, f.name)}' for f in dataclasses.fields(options)
      if f.metadata.get('in_spec', True) or getattr(options, f.name) != f.default)
