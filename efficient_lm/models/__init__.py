"""Building a model: `create(model_config, rngs=...)` builds the model named by `model.name`.

The families register themselves (`models/registry.py`: each module of this package calls
`registry.register` at import, and this package imports them all once, below), each model with the typed
config its family declares (`efficient_lm.families`: `config.model.ModelConfig`'s subclass, its
fields, their checks, its attention patterns). Every function here takes that typed config (a
`RunConfig`'s `model`). Adding a model is a module here, its config class in `families/` and a
config file (docs/adding_a_model.md); no shared file changes.

A wing of the package (docs/architecture.md, "The wings"): it may import `families`, `ops`,
`parallel`, `config` and `runtime`; never `data` (declared independent: a model knows no data
pipeline), nor the state, training, inference or evaluation built on it.
"""

import importlib
import pkgutil
from typing import Any, NamedTuple

import jax
from flax import nnx

from efficient_lm.parallel import targets
from efficient_lm.config.model import ModelConfig
from efficient_lm.models import decoder
from efficient_lm.models import placement
from efficient_lm.models.placement import validate_attention_impl, validate_context
from efficient_lm.models.registry import REGISTRY, ModelEntry
from efficient_lm.parallel import sharding
from efficient_lm.ops.core import backends
from efficient_lm.ops.pattern import Pattern
from efficient_lm.ops.route import Route
from efficient_lm.config.errors import ConfigError

for _info in pkgutil.iter_modules(__path__):  # every module of the package once: each family's
  importlib.import_module(f"{__name__}.{_info.name}")  # registers itself; adding one touches no shared file


def logical_axes() -> dict[str, sharding.Axis]:
  """Every logical parameter axis: the decoder's and each model's own (what `mesh.rules` may
  name). Two models declaring one name must mean the same axis."""
  axes = dict(sharding.SHARED_AXES)
  for name, entry in REGISTRY.items():
    for axis, spec in entry.logical_axes.items():
      if axes.setdefault(axis, spec) != spec:
        raise ValueError(f"models.REGISTRY[{name!r}] declares logical axis {axis!r} as {spec}, "
                         f"already declared as {axes[axis]}: give it another name")
  return axes


def _build(cfg: ModelConfig, rngs: nnx.Rngs, route: Route) -> nnx.Module:
  """The model `cfg.name` on `route`, unvalidated."""
  entry = REGISTRY[cfg.name]
  if entry.build is not None:
    return entry.build(cfg, rngs, route=route)
  return decoder.Decoder(cfg, lambda layer, rngs: entry.make_mixer(cfg, layer, rngs, route=route),
                         identical_layers=(entry.identical_layers(cfg) if entry.identical_layers
                                           else cfg.identical_layers), rngs=rngs)


def attention_patterns(cfg: ModelConfig) -> tuple[Pattern, ...]:
  """Every attention pattern the model trains with (its config's `patterns()`)."""
  return cfg.patterns()


def context_block(cfg: ModelConfig) -> int:
  """`ModelConfig.context_block` of a model section."""
  return cfg.context_block


def chunkable(cfg: ModelConfig) -> bool:
  """`ModelConfig.chunkable` of a model section."""
  return cfg.chunkable


def ring_layout(cfg: ModelConfig) -> str:
  """`ModelConfig.ring_layout` of a model section."""
  return cfg.ring_layout


def validate(cfg: ModelConfig, platform: str | None = None) -> ModelConfig:
  """`cfg` (its fields checked at construction), its attention backend checked against
  `platform` (default: jax's backend); raises ConfigError."""
  validate_attention_impl(cfg, platform or jax.default_backend())
  return cfg


def attention_backend_name(cfg: ModelConfig, platform: str) -> str:
  """The backend `model.attention_impl` means on `platform` (`auto` resolved)."""
  return backends.resolve(cfg.attention_impl, platform)


def context_size(mesh: jax.sharding.Mesh | None, axis_name: str = "context") -> int:
  """Devices along the sequence axis (1 without a mesh or without that axis)."""
  if mesh is None or axis_name not in mesh.axis_names:
    return 1
  return mesh.shape[axis_name]


def sequence_layout(cfg: ModelConfig, mesh: jax.sharding.Mesh | None) -> str:
  """The order the training loop feeds tokens in: 'natural', or 'zigzag' (`ops.ring`)."""
  return cfg.ring_layout if context_size(mesh) > 1 else "natural"


_VALIDATED: set[tuple[ModelConfig, str, int]] = set()  # (model, platform, context) seen valid


def create(cfg: ModelConfig, *, rngs: nnx.Rngs, mesh: jax.sharding.Mesh | None = None,
           platform: str | None = None) -> nnx.Module:
  """Builds the model `cfg.name`; its `__call__(tokens_BT)` returns logits `[B, T', V]`.

  `T'` is T for every causal LM; a model that predicts only some positions
  (Perceiver-AR) returns the last `T'` of them. Every parameter carries its
  logical axis names (`out_sharding` metadata, see `efficient_lm.parallel.sharding`);
  the model itself is created unplaced (`train_state.build` places it). With a
  `mesh` whose `context` axis has several devices the route shards the
  sequence (`ops.ring`); the batch must then come in
  `sequence_layout(cfg, mesh)` order with its positions. The attention runs on
  the backend `model.attention_impl` names for the platform of the mesh's
  devices (or `platform`, for a model built from shapes only).
  """
  if platform is None:
    platform = targets.platform_of(list(mesh.devices.flat) if mesh is not None else jax.devices())
  context = context_size(mesh)
  if (cfg, platform, context) not in _VALIDATED:  # a run builds its model several times
    placement.ModelPlacement(model=cfg, platform=platform, context=context)  # (its rules run)
    _VALIDATED.add((cfg, platform, context))
  route = Route(impl=attention_backend_name(cfg, platform), interpret=cfg.kernel_interpret,
                mesh=mesh if context > 1 else None, layout=sequence_layout(cfg, mesh))
  return _build(cfg, rngs, route)


class AbstractModel(NamedTuple):
  """A model built from shapes only (`abstract_model`): nothing is allocated."""
  graphdef: Any  # its structure (nnx.graphdef)
  params: Any    # its parameters as shapes, with their logical axis names
  layout: str    # the order it takes a batch's tokens in on its mesh (`sequence_layout`)


def abstract_model(cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None,
                   platform: str | None = None) -> AbstractModel:
  """The model built from shapes only: what the edge checks the mesh against, and what
  `train_state.build` makes an abstract train state of (the model is not built again)."""
  layout = sequence_layout(cfg, mesh)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: create(cfg, rngs=nnx.Rngs(0), mesh=mesh,
                                                             platform=platform)))
  return AbstractModel(graphdef, params, layout)


def abstract_params(cfg: ModelConfig, platform: str | None = None):
  """The model's parameters as shapes with their logical axis names; nothing is allocated."""
  return abstract_model(cfg, platform=platform)[1]


__all__ = ["AbstractModel", "ConfigError", "ModelConfig", "REGISTRY", "ModelEntry", "abstract_model",
           "abstract_params",
           "attention_backend_name", "attention_patterns", "chunkable", "context_block",
           "context_size", "create", "logical_axes", "ring_layout",
           "sequence_layout", "validate", "validate_attention_impl", "validate_context"]
