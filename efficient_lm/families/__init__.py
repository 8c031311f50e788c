"""Each model family's typed config, as its module here declares it: the family's fields (each with
its default, meaning and checks), its cross-field rules, the attention patterns it trains with
(`patterns(seq_len)`, from which the library derives whether the blocks run over sequence chunks
and the block a device's share must be a multiple of), and, for each model the module declares
(`MODELS`), the line `--help` lists it with. `CLASSES` maps `model.name` to its config class: what
`config.run.build` types a config's model section with.

A wing between `models` and `ops` (docs/architecture.md, "The wings"): it may import `ops` (the
patterns, `ops.pattern`, which loads no jax) and `config`; nothing here imports jax, so `--help`
and every config check answer before jax starts. `models/<family>.py` builds the mixers of the
models its namesake here declares (`models.registry.register`).
"""

import importlib
import pkgutil
from types import ModuleType

from efficient_lm.config.model import ModelConfig


CLASSES: dict[str, type[ModelConfig]] = {}  # model.name -> its config class
LISTINGS: dict[str, tuple[str, str]] = {}   # model.name -> `--help`'s line


def declare(module: ModuleType) -> None:
  """Adds the models a family's module declares (its `MODELS`: {model.name: (config class,
  --config=, line)}); a name declared twice is an error."""
  for name, (config, spec, line) in module.MODELS.items():
    if CLASSES.get(name, config) is not config:
      raise ValueError(f"model {name!r} is declared twice ({CLASSES[name].__name__} and "
                       f"{config.__name__}); give one of them another name")
    CLASSES[name] = config
    LISTINGS[name] = (spec, line)


for _info in pkgutil.iter_modules(__path__):  # every module of the package, in order: adding a
  declare(importlib.import_module(f"{__name__}.{_info.name}"))  # family touches no shared file

__all__ = ["CLASSES", "LISTINGS", "declare"]
