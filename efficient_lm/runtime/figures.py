"""Figures as JSON that every strict parser reads: what each writer of figures goes through (the
result lines on stdout, `metrics.jsonl`, the results files of `evaluate` and the exports).

JSON has no NaN or Infinity (`jq` and strict parsers reject Python's bare `NaN`). A figure that
could not be had (bits per byte of a text the tokenizer does not give back, the loss of a split
with no text) or is not finite is written as `null` with `<name>_reason` beside it, saying why:

    figures.withheld("bits_per_byte", "...")  # {"bits_per_byte": None, "bits_per_byte_reason": "..."}
    figures.dumps(record)                     # json.dumps of `jsonable(record)`, allow_nan=False
    figures.dump(record, f, indent=1)         # the same, to a file
    figures.numbers(record)                   # its finite numbers (TensorBoard, W&B)
    figures.shown(value, ".4f")               # a log line's text of a figure: 'null' for none

Imports nothing of the package (every command may use it before anything heavy).
"""

import json
import math
import numbers as numbers_lib
from typing import Any

REASON = "_reason"  # `<name>_reason`: why `<name>` is null


def withheld(name: str, reason: str) -> dict:
  """The figure `name` as null, and why."""
  return {name: None, name + REASON: reason}


def _scalar(value: Any) -> Any:
  """A 0-d array or a numpy / jax scalar as the Python number it holds; anything else as it is."""
  if not isinstance(value, (bool, int, float, str)) and getattr(value, "shape", None) == () and (
      hasattr(value, "item")):
    return value.item()
  return value


def not_finite(value: Any) -> bool:
  """Whether `value` is a real number that is NaN or infinite."""
  value = _scalar(value)
  return (isinstance(value, numbers_lib.Real) and not isinstance(value, numbers_lib.Integral)
          and not math.isfinite(value))


def jsonable(obj: Any) -> Any:
  """`obj` with every number that is not finite replaced by None (and numpy / jax scalars by
  Python's). In a mapping, `<key>_reason` is added beside a key whose value was not finite, or
  whose list held such a value, unless the mapping gives that reason itself."""
  obj = _scalar(obj)
  if isinstance(obj, dict):
    out, given = {}, set(obj)
    for key, value in obj.items():
      out[key] = jsonable(value)
      value = _scalar(value)
      if not_finite(value):
        reason = f"not a finite number ({float(value)})"
      elif isinstance(value, (list, tuple)) and any(not_finite(v) for v in value):
        reason = "values that were not finite numbers are null"
      else:
        continue
      if f"{key}{REASON}" not in given:
        out[f"{key}{REASON}"] = reason
    return out
  if isinstance(obj, (list, tuple)):
    return [jsonable(v) for v in obj]
  return None if not_finite(obj) else obj


def dumps(obj: Any, **kwargs) -> str:
  """JSON text of `jsonable(obj)`; anything json would still write as NaN is an error."""
  return json.dumps(jsonable(obj), allow_nan=False, **kwargs)


def dump(obj: Any, f, **kwargs) -> None:
  """`dumps(obj)` written to the open file `f`."""
  json.dump(jsonable(obj), f, allow_nan=False, **kwargs)


def numbers(record: dict) -> dict[str, float]:
  """The entries of `record` that are finite real numbers, as floats (what a scalar logger takes:
  a null figure and its reason are left out)."""
  out = {}
  for key, value in record.items():
    value = _scalar(value)
    if isinstance(value, numbers_lib.Real) and not isinstance(value, bool) and math.isfinite(value):
      out[key] = float(value)
  return out


def shown(value: Any, spec: str = ".4f") -> str:
  """`value` formatted with `spec` for a log line, or 'null' where there is no finite figure."""
  value = _scalar(value)
  return "null" if value is None or not_finite(value) else format(value, spec)
