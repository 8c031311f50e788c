"""Each family's settings for the shared model tests, one module here per module of
`efficient_lm/models/` (the family's third file: docs/adding_a_model.md).

A module declares, for the models its family registers:

- `FIELDS`: {model: fields} at the tests' sizes (seq_len 32, d_model 32), chosen so that every
  part of the model is exercised (`test_models.tiny_model_config`; most shared tests);
- `TASKS`: {model: (fields, d, reach(t))} for `test_learning` (copy the token d back, scored
  where reach(t)), or `NO_TASK`: {model: one line saying why no such task fits it};
- `DECODING` (optional): [(model, fields)], more cached-decoding cases than its `FIELDS`.

The shared tests read them merged (`merged`), and check that every registered model has its
`FIELDS` and a task or a reason.
"""

import importlib
import pkgutil


def modules() -> list:
  return [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)]


def merged(name: str) -> dict:
  """Every family module's `name` dict, merged (a model declared twice is an error)."""
  out = {}
  for module in modules():
    for model, value in getattr(module, name, {}).items():
      assert model not in out, f"{model} is declared twice in tests/families/*.{name}"
      out[model] = value
  return out


def decoding() -> list[tuple[str, dict]]:
  """Every family module's `DECODING` cases, in module order."""
  return [case for module in modules() for case in getattr(module, "DECODING", [])]
