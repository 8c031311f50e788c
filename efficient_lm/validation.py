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


def require_positive_int(field: str, value: Any) -> None:
  require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
          field, value, "must be a positive integer", f"set {field} to an integer >= 1")
