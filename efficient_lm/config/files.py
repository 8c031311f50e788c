"""Configs by path or by name: the config files the command lines, the help listing and the
library load.

    --config=configs/pi_attention.py        a config file (`:preset` after it: configs/bcmt.py:128)
    --config=pi_attention  --config=bcmt:128  a config shipped with the package, by name

Imports no jax (the config files import only `config_base`).
"""

import importlib.resources
import importlib.util
import os

import ml_collections

from efficient_lm.config.errors import ConfigError


def config_names() -> tuple[str, ...]:
  """The configs shipped with the package (`efficient_lm.configs`, the repository's configs/)."""
  folder = importlib.resources.files("efficient_lm.configs")
  return tuple(sorted(p.name[:-3] for p in folder.iterdir()
                      if p.name.endswith(".py") and not p.name.startswith("_")))


def resolve(spec: str) -> str:
  """'pi_attention', 'bcmt:128' or 'configs/bcmt.py:128' -> '<existing path>[:preset]'; a
  ConfigError naming the shipped configs when it is neither a file nor one of them."""
  path, colon, preset = spec.partition(":")
  if os.path.isfile(os.path.expanduser(path)):
    return spec
  name = os.path.splitext(os.path.basename(path))[0]
  if name in config_names() and (path == name or not os.path.dirname(path)
                                 or path.startswith("configs/")):
    packaged = importlib.resources.files("efficient_lm.configs") / f"{name}.py"
    return f"{packaged}{colon}{preset}"
  raise ConfigError(f"--config={spec!r} is neither a config file nor a shipped config; give a path "
                    f"such as configs/pi_attention.py, or one of {', '.join(config_names())} "
                    "(with :preset after it, e.g. bcmt:128)")


def load_config(spec: str, *, shown: str | None = None) -> ml_collections.ConfigDict:
  """The ConfigDict of `spec` (`resolve`'s forms): its file's `get_config(preset)`. An unknown
  preset is a ConfigError with the file's message (which names its presets); `shown` is how the
  spec is named in it (default `spec`)."""
  path, _, preset = resolve(spec).partition(":")
  module_spec = importlib.util.spec_from_file_location(
      f"efficient_lm_config_{os.path.splitext(os.path.basename(path))[0]}", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  try:
    return module.get_config(preset or None)
  except ValueError as e:
    raise ConfigError(f"--config={shown or spec}: {e}") from None


__all__ = ["config_names", "load_config", "resolve"]
