"""Config errors that name the field, the value and the fix.

Every check runs before any data is prepared or anything is compiled, so a bad
config fails in well under a second with one line such as::

    config error: model.d_model=250 must be divisible by model.num_heads=4; set model.d_model to a multiple of 4
"""

from typing import Any


class ConfigError(ValueError):
  """A config field has a value the library cannot run with."""


def require(ok: bool, field: str, value: Any, requirement: str, fix: str) -> None:
  """Raises ConfigError(`field=value requirement; fix`) unless `ok`."""
  if not ok:
    raise ConfigError(f"{field}={value!r} {requirement}; {fix}")


def is_int(value: Any) -> bool:
  """An int and not a bool: the library's one integer check (configs, patterns, plans)."""
  return isinstance(value, int) and not isinstance(value, bool)


def require_positive_int(field: str, value: Any) -> None:
  require(is_int(value) and value > 0,
          field, value, "must be a positive integer", f"set {field} to an integer >= 1")


def divisors_near(n: int, near: int, count: int = 3) -> list[int]:
  """The `count` divisors of n closest to `near`, ascending (for the fix of an error message)."""
  divisors = set()
  d = 1
  while d * d <= n:
    if n % d == 0:
      divisors.update((d, n // d))
    d += 1
  return sorted(sorted(divisors, key=lambda x: (abs(x - near), x))[:count])
