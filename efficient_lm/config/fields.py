"""Typed config sections: frozen dataclasses whose fields declare their default, meaning and check.

A section is a frozen, keyword-only dataclass deriving from `Section`; each field is declared
with `setting(default, doc, check)`; its cross-field rules are `Rule`s declared in the class's
`RULES`. Constructing one runs every field's declared check, then the rules (`check()`), and a
failure is one `ConfigError` naming the field, the value and the fix::

    model.d_model=250 must be divisible by model.num_heads=4; set model.d_model to a multiple of 4

The ml-collections config files stay the user's interface: `config_base` builds the ConfigDict
from these defaults, and one function (`run.build`) turns the ConfigDict into the typed sections
of a `RunConfig`, each through `Section.from_mapping`. This module imports no jax (`--help`
reads it).
"""

import dataclasses
import re
from typing import Any, Callable, ClassVar, Mapping

from efficient_lm.config.errors import ConfigError, is_int, require


@dataclasses.dataclass(frozen=True)
class Check:
  """`ok(value)`, else `{field}={value!r} {requirement}; {fix}` (`{field}` in `fix` is the
  field's dotted name)."""
  ok: Callable[[Any], bool]
  requirement: str
  fix: str

  def __call__(self, field: str, value: Any) -> None:
    if not self.ok(value):
      raise ConfigError(f"{field}={value!r} {self.requirement}; {self.fix.format(field=field)}")

  def describe(self) -> str:
    """The requirement, for `--help`."""
    return self.requirement


@dataclasses.dataclass(frozen=True)
class Each(Check):
  """A mapping field's check of each entry: `ok(key, value)`, else
  `{field}.{key}={value!r} {requirement}; {fix}` (`{field}` in `fix` is the entry's name)."""

  def __call__(self, field: str, value: Any) -> None:
    for key, entry in value.items():
      if not self.ok(key, entry):
        Check(lambda _: False, self.requirement, self.fix)(f"{field}.{key}", entry)


@dataclasses.dataclass(frozen=True)
class Rule:
  """A cross-field rule, declared in a section's `RULES`: unless `ok(section)`, a ConfigError
  `{field}={value!r} {requirement}; {fix}`. `field`, `requirement` and `fix` are format strings
  over the section's fields and the names `derive(section)` adds (`'{num_heads}'`); `value`
  (default: the named field's) gives the value; with `when`, the rule applies only where
  `when(section)` holds. `--help` states `describe()`."""
  field: str
  ok: Callable[[Any], bool]
  requirement: str
  fix: str
  when: Callable[[Any], bool] | None = None
  derive: Callable[[Any], dict] | None = None
  value: Callable[[Any], Any] | None = None

  def __call__(self, section: "Section") -> None:
    if (self.when is not None and not self.when(section)) or self.ok(section):
      return
    names = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
    names.update(self.derive(section) if self.derive else {})
    field = self.field.format(**names)
    value = self.value(section) if self.value else names[field.split(".", 1)[1]]
    raise ConfigError(f"{field}={value!r} {self.requirement.format(**names)}; "
                      f"{self.fix.format(**names)}")

  def describe(self) -> str:
    """The rule as `--help` states it: the field and the requirement, its names in braces."""
    return f"{self.field} {re.sub(r'![rs]}', '}', self.requirement)}"


def positive_int(fix: str = "set {field} to an integer >= 1") -> Check:
  return Check(lambda v: is_int(v) and v > 0, "must be a positive integer", fix)


def non_negative_int(requirement: str = "must be a non-negative integer",
                     fix: str = "set {field} to an integer >= 0") -> Check:
  return Check(lambda v: is_int(v) and v >= 0, requirement, fix)


def boolean(fix: str = "set {field}=False or True") -> Check:
  return Check(lambda v: isinstance(v, bool), "must be True or False", fix)


def one_of(choices: tuple[Any, ...], requirement: str = "is not a known choice",
           fix: str | None = None) -> Check:
  fix = fix or "use one of " + ", ".join(map(str, choices))
  return Check(lambda v: isinstance(v, type(choices[0])) and v in choices, requirement, fix)


def number_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False,
              requirement: str | None = None, fix: str = "set {field} inside that range",
              floats_only: bool = False) -> Check:
  """A number in [low, high] (each end open if asked); `floats_only`: a float, never an int."""
  def ok(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, float if floats_only else (int, float)):
      return False
    return (low < v if low_open else low <= v) and (v < high if high_open else v <= high)
  span = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
  return Check(ok, requirement or f"must be {'a float ' if floats_only else ''}in {span}", fix)


def setting(default: Any = dataclasses.MISSING, doc: str = "",
            check: Check | tuple[Check, ...] | None = None, *,
            factory: Callable[[], Any] | None = None):
  """A section field: its default (none: the edge must give it), one line saying what it is, and
  its check (or checks, run in order). `factory`: makes the default instead (a mapping, which a
  dataclass cannot share)."""
  if factory is not None:
    return dataclasses.field(default_factory=factory, metadata={"doc": doc, "check": check})
  return dataclasses.field(default=default, metadata={"doc": doc, "check": check})


def _has_default(field: dataclasses.Field) -> bool:
  return (field.default is not dataclasses.MISSING
          or field.default_factory is not dataclasses.MISSING)


class Section:
  """Base of a typed section: `SECTION` names it in messages ('model'); `RULES` declares its
  cross-field rules. `__post_init__` runs each field's declared check in order, then `check()`:
  the section's `all_rules()` in order."""
  SECTION: ClassVar[str] = ""
  RULES: ClassVar[tuple[Rule, ...]] = ()

  def __post_init__(self) -> None:
    for field in dataclasses.fields(self):
      checks = field.metadata.get("check")
      for check in checks if isinstance(checks, tuple) else (checks,) if checks else ():
        check(self.name_of(field.name), getattr(self, field.name))
    self.check()

  def check(self) -> None:
    """Cross-field rules of the section (each failure a `ConfigError`): `all_rules()`, in order."""
    for rule in self.all_rules():
      rule(self)

  @classmethod
  def all_rules(cls) -> tuple[Rule, ...]:
    """The section's cross-field rules in the order they run (`--help` states them)."""
    return cls.RULES

  @classmethod
  def name_of(cls, field: str) -> str:
    return f"{cls.SECTION}.{field}"

  @classmethod
  def from_mapping(cls, section: Mapping[str, Any], owner: str = ""):
    """The typed section of a mapping (a ConfigDict section, a dict): a field it lacks takes its
    default; a key the class does not declare, or a field without a default it lacks, is a
    ConfigError naming it (`owner`: whose fields, for the message, e.g. "model.name='dense'")."""
    declared = cls.declared()
    # A sub-section (a ConfigDict's `mesh.rules`) is held as a plain dict: the typed section
    # never hands the ConfigDict on.
    values = {k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in section.items()}
    whose = f"of {owner}" if owner else f"of the {cls.SECTION} section"
    for key, value in values.items():
      require(key in declared, cls.name_of(key), value, f"is not a field {whose}",
              f"remove it, or use one of its fields: {', '.join(declared)}")
    for key, field in declared.items():
      require(key in values or _has_default(field), cls.name_of(key), None,
              "is missing", f"set {cls.name_of(key)} (start from a file in configs/)")
    # A sub-section lacking keys (a config.json written before a rule existed) takes them at
    # the default's, as a missing field takes its default.
    defaults = cls.defaults()
    for key, value in values.items():
      if isinstance(value, dict) and isinstance(defaults.get(key), dict):
        values[key] = {**defaults[key], **value}
    return cls(**values)

  @classmethod
  def declared(cls) -> dict[str, dataclasses.Field]:
    """Every field the section declares, in order."""
    return {f.name: f for f in dataclasses.fields(cls)}

  @classmethod
  def defaults(cls) -> dict[str, Any]:
    """The fields that have a default, with it (a factory's made anew)."""
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls) if _has_default(f)}

  @classmethod
  def docs(cls) -> dict[str, str]:
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


__all__ = ["Check", "Each", "Rule", "Section", "boolean", "non_negative_int", "number_in", "one_of",
           "positive_int", "setting"]
