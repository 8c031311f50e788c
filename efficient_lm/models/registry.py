"""The model registry: each family's module registers itself; `model_config` is the typed edge.

A family's module (any module of the `efficient_lm.models` package) calls `register(name,
ModelEntry(...))` at import; `discover()` imports every module of the package once, so adding a
family touches no shared file (docs/adding_a_model.md). `model_config(section)` turns a config's
model section (a ConfigDict, or any mapping with `.items()`) into the family's typed
`ModelConfig`: the one place a model section is read; everything under `models/` and `ops/`
takes the typed object.
"""

import dataclasses
import importlib
import pkgutil
from typing import Any, Callable, Mapping

from efficient_lm.parallel import sharding
from efficient_lm.config.model import ModelConfig
from efficient_lm.config.errors import ConfigError, require


@dataclasses.dataclass(frozen=True)
class ModelEntry:
  """How to build one model.

  `config`: the family's `ModelConfig` subclass (its fields, their checks, and its
  `patterns(seq_len)`). Most models are the shared decoder with their own mixer: `make_mixer(cfg,
  layer, rngs, *, route)`, with `identical_layers(cfg)` saying whether the layers can be scanned
  (default: the config's `identical_layers`). A model with another structure (Perceiver-AR)
  gives `build(cfg, rngs, *, route)` instead. Either way the module has `__call__(tokens_BT, *,
  positions_BT, segment_ids_BT)`, `hidden(...)`, `embed_tokens(tokens_BT)` and
  `from_embeddings(x_BTD)` (tests differentiate through it), and reaches attention only through
  `route` (`ops.route.Route`: the backend, and the ring when the sequence is sharded).

  `listing`: (the `--config=` that trains it, one line), what `--help` lists (required).
  A model whose structure has no ring (Perceiver-AR's latents) has `context_parallel=False` and
  says why in `no_context_parallel`. `logical_axes`: the logical axis names its own parameters
  carry beyond the decoder's (`sharding.SHARED_AXES`), each with the config field that sets its
  size and its default `mesh.rules` entry.
  """
  config: type[ModelConfig] = ModelConfig
  make_mixer: Callable[..., Any] | None = None
  identical_layers: Callable[[ModelConfig], bool] | None = None  # None: cfg.identical_layers
  build: Callable[..., Any] | None = None
  context_parallel: bool = True
  no_context_parallel: str = "it has no ring version of its attention"  # why, if not supported
  logical_axes: Mapping[str, sharding.Axis] = dataclasses.field(default_factory=dict)
  # `--help`'s line: the shipped config that trains it (`--config=` form) and what it is. Written
  # as literals in the `register` call (or a module-level dict indexed by the loop's name), which
  # `cli/help.py` reads from the source without importing jax.
  listing: tuple[str, str] = ("", "")


REGISTRY: dict[str, ModelEntry] = {}


def register(name: str, entry: ModelEntry) -> ModelEntry:
  """Adds the model `name` (a family module calls this at import); a name registered twice by
  different entries is an error."""
  if not (len(entry.listing) == 2 and all(entry.listing)):
    raise ValueError(f"model {name!r}: its ModelEntry needs listing=('<config>', '<one line>'), "
                     "what --help lists")
  old = REGISTRY.get(name)
  same = lambda e: (e.config.__module__, e.config.__qualname__)  # (a module imported again)
  if old is not None and old != entry and same(old) != same(entry):
    raise ValueError(f"model {name!r} is registered twice ({REGISTRY[name]} and {entry}): "
                     "give one of them another name")
  REGISTRY[name] = entry
  return entry


_DISCOVERED = False


def discover() -> dict[str, ModelEntry]:
  """Imports every module of the `efficient_lm.models` package once (each family registers
  itself); returns the registry."""
  global _DISCOVERED
  if not _DISCOVERED:
    package = importlib.import_module("efficient_lm.models")
    for module in pkgutil.iter_modules(package.__path__):
      importlib.import_module(f"efficient_lm.models.{module.name}")
    _DISCOVERED = True
  return REGISTRY


def family(name: Any) -> type[ModelConfig]:
  """The typed config class of the model `name` (`model.name`); ConfigError if none is
  registered."""
  discover()
  require(name in REGISTRY, "model.name", name, "is not a known model",
          f"use one of {', '.join(sorted(REGISTRY))}")
  return REGISTRY[name].config


def model_config(section: Any) -> ModelConfig:
  """The typed model config of a model section: a ConfigDict's `model` section (or the whole
  config), after `config_base.fill_defaults` or not (a field it lacks takes the dataclass's
  default); a `ModelConfig` is returned as it is. Raises ConfigError for an unknown
  `model.name`, a field its family does not declare, or a value its checks refuse."""
  if isinstance(section, ModelConfig):
    return section
  if "name" not in section and "model" in section:  # the whole config
    section = section["model"]
  name = section["name"] if "name" in section else None
  return family(name).from_mapping(section, owner=f"model.name={name!r}")


def logical_axes() -> dict[str, sharding.Axis]:
  """Every logical parameter axis: the decoder's and each model's own (what `mesh.rules` may
  name). Two models declaring one name must mean the same axis."""
  axes = dict(sharding.SHARED_AXES)
  for name, entry in discover().items():
    for axis, spec in entry.logical_axes.items():
      if axes.setdefault(axis, spec) != spec:
        raise ValueError(f"models.REGISTRY[{name!r}] declares logical axis {axis!r} as {spec}, "
                         f"already declared as {axes[axis]}: give it another name")
  return axes


__all__ = ["ConfigError", "ModelEntry", "REGISTRY", "discover", "family", "logical_axes", "model_config",
           "register"]
