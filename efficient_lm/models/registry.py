"""The model registry: each family's module registers how to build the models it declares.

A family's module (any module of the `efficient_lm.models` package) calls `register(name,
ModelEntry(...))` at import for each model its namesake in `efficient_lm/families/` declares (the
typed config and `--help`'s line come from there); the package (`efficient_lm.models`) imports
every one of its modules once, so adding a family touches no shared file (docs/adding_a_model.md).
This module imports none of them: a family's module imports it, never the other way round. Everything under
`models/` and `ops/` takes the typed config (`config.run.build` types a config's model section).
"""

import dataclasses
from typing import Any, Callable, Mapping

from efficient_lm import families
from efficient_lm.config.errors import ConfigError
from efficient_lm.config.model import ModelConfig
from efficient_lm.parallel import sharding


@dataclasses.dataclass(frozen=True)
class ModelEntry:
  """How to build one model.

  `config`: the family's `ModelConfig` subclass (its fields, their checks, and its
  `patterns(seq_len)`) and `listing`, `--help`'s line: both as `efficient_lm.families` declares
  the model (`register` fills them in). Most models are the shared decoder with their own mixer: `make_mixer(cfg,
  layer, rngs, *, route)`, with `identical_layers(cfg)` saying whether the layers can be scanned
  (default: the config's `identical_layers`). A model with another structure (Perceiver-AR)
  gives `build(cfg, rngs, *, route)` instead. Either way the module has `__call__(tokens_BT, *,
  positions_BT, segment_ids_BT)`, `hidden(...)`, `embed_tokens(tokens_BT)` and
  `from_embeddings(x_BTD)` (tests differentiate through it), and reaches attention only through
  `route` (`ops.route.Route`: the backend, and the ring when the sequence is sharded).

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
  listing: tuple[str, str] = ("", "")  # (the `--config=` that trains it, one line): `--help`'s


REGISTRY: dict[str, ModelEntry] = {}


def register(name: str, entry: ModelEntry) -> ModelEntry:
  """Adds the model `name` (a family module calls this at import), its config class and listing
  as `efficient_lm.families` declares it; a name no family declares, or registered twice by
  different entries, is an error."""
  if name not in families.CLASSES:
    raise ValueError(f"model {name!r} is not declared in efficient_lm/families/: declare its config "
                     "class and --help line there (MODELS), then register how to build it")
  entry = dataclasses.replace(entry, config=families.CLASSES[name], listing=families.LISTINGS[name])
  old = REGISTRY.get(name)
  # the function that builds it, by name: a module imported again registers equal builders
  same = lambda e: tuple((f.__module__, f.__qualname__) if f is not None else None
                         for f in (e.make_mixer, e.build))
  if old is not None and old != entry and same(old) != same(entry):
    raise ValueError(f"model {name!r} is registered twice ({REGISTRY[name]} and {entry}): "
                     "give one of them another name")
  REGISTRY[name] = entry
  return entry


__all__ = ["ConfigError", "ModelEntry", "REGISTRY", "register"]
