"""Model registry: `create(model_config, rngs=...)` builds the model named by `model.name`.

Each entry says how to build one layer's mixer, whether all layers are
identical (scanned), which model-specific fields to validate and which logical
axes its own parameters carry; everything about attention is read from the
mixers' own patterns. Adding a model is adding an entry here, a module beside
this one and a config (docs/adding_a_model.md).
"""

import dataclasses
import math
from typing import Callable, Mapping

import jax
import ml_collections
from flax import nnx

from efficient_lm.models import bcmt
from efficient_lm.models import decoder
from efficient_lm.models import dense
from efficient_lm.models import ecp
from efficient_lm.models import perceiver_ar
from efficient_lm.models import pi_attention
from efficient_lm import sharding
from efficient_lm import targets
from efficient_lm.ops import route as route_lib
from efficient_lm.ops.core import backends
from efficient_lm.ops.pattern import Pattern
from efficient_lm.ops.route import Route
from efficient_lm.validation import ConfigError, require, require_positive_int


@dataclasses.dataclass(frozen=True)
class ModelEntry:
  """How to build one model.

  Most models are the shared decoder with their own mixer: `make_mixer(cfg,
  layer, rngs, *, route)`, with `identical_layers(cfg)` saying whether the
  layers can be scanned. A model with another structure (Perceiver-AR) gives
  `build(cfg, rngs, *, route)` instead. Either way the module has
  `__call__(tokens_BT, *, positions_BT, segment_ids_BT)`, `hidden(...)`,
  `embed_tokens(tokens_BT)` and `from_embeddings(x_BTD)` (tests differentiate
  through it), and reaches attention only through `route` (`ops.route.Route`:
  the backend, and the ring when the sequence is sharded).

  Everything about attention is read from the modules' own `patterns` (each
  mixer states its pattern once): which backends can run them, whether the
  blocks can run over sequence chunks (bounded reach), the block each device's
  chunk must be a multiple of, the ring and the sequence layout of context
  parallelism. A model whose structure has no ring (Perceiver-AR's latents)
  has `context_parallel=False` and says why in `no_context_parallel`.

  `logical_axes`: the logical axis names its own parameters carry beyond the
  decoder's (`sharding.SHARED_AXES`), each with the config field that sets its
  size and its default `mesh.rules` entry.
  """
  make_mixer: Callable[..., nnx.Module] | None = None
  identical_layers: Callable[[ml_collections.ConfigDict], bool] = lambda cfg: True
  validate: Callable[[ml_collections.ConfigDict], None] = lambda cfg: None
  build: Callable[..., nnx.Module] | None = None
  context_parallel: bool = True
  no_context_parallel: str = "it has no ring version of its attention"  # why, if not supported
  logical_axes: Mapping[str, sharding.Axis] = dataclasses.field(default_factory=dict)


REGISTRY: dict[str, ModelEntry] = {
    "dense": ModelEntry(make_mixer=dense.make_mixer),
    "ecp": ModelEntry(make_mixer=ecp.make_mixer, identical_layers=ecp.identical_layers,
                      validate=ecp.validate),
    **{name: ModelEntry(build=perceiver_ar.build, validate=perceiver_ar.validate,
                        context_parallel=False,
                        no_context_parallel="no ring version of its latent cross-attention",
                        logical_axes=perceiver_ar.LOGICAL_AXES)
       for name in perceiver_ar.VARIANTS},
    "bcmt": ModelEntry(make_mixer=bcmt.make_mixer, validate=bcmt.validate,
                       logical_axes=bcmt.LOGICAL_AXES),
    "honly": ModelEntry(make_mixer=bcmt.make_honly_mixer, validate=bcmt.validate_honly),
    "pi_attention": ModelEntry(make_mixer=pi_attention.make_pi_mixer,
                               identical_layers=lambda cfg: cfg.period_schedule == "constant",
                               validate=pi_attention.validate_pi,
                               logical_axes=pi_attention.LOGICAL_AXES),
    "sliding_window": ModelEntry(make_mixer=pi_attention.make_sliding_window_mixer,
                                 validate=pi_attention.validate_sliding_window),
}


def _build(cfg: ml_collections.ConfigDict, rngs: nnx.Rngs, route: Route) -> nnx.Module:
  """The model `cfg.name` on `route`, unvalidated."""
  entry = REGISTRY[cfg.name]
  if entry.build is not None:
    return entry.build(cfg, rngs, route=route)
  return decoder.Decoder(cfg, lambda layer, rngs: entry.make_mixer(cfg, layer, rngs, route=route),
                         identical_layers=entry.identical_layers(cfg), rngs=rngs)


_PATTERNS: dict[str, tuple[Pattern, ...]] = {}


def attention_patterns(cfg: ml_collections.ConfigDict) -> tuple[Pattern, ...]:
  """Every attention pattern the model trains with, read from its modules' `patterns` (the model
  built from shapes only; nothing is allocated)."""
  key = cfg.to_json_best_effort(sort_keys=True)
  if key not in _PATTERNS:
    model = nnx.eval_shape(lambda: _build(cfg, nnx.Rngs(0), route_lib.DEFAULT))
    found = []
    for _, module in model.iter_modules():
      found += [p for p in getattr(module, "patterns", ()) if p not in found]
    _PATTERNS[key] = tuple(found)
  return _PATTERNS[key]


def context_block(cfg: ml_collections.ConfigDict) -> int:
  """What each device's (or sequence chunk's) share of the sequence must be a multiple of: the
  patterns' blocks (BCMT's block, ECP's piece), 1 without blocks."""
  return math.lcm(1, *(p.block_size for p in attention_patterns(cfg) if p.block_size))


def chunkable(cfg: ml_collections.ConfigDict) -> bool:
  """Whether the blocks can run over sequence chunks: every pattern's reach is bounded."""
  return all(p.reach is not None for p in attention_patterns(cfg))


def ring_layout(cfg: ml_collections.ConfigDict) -> str:
  """The sequence order a sharded sequence arrives in: 'zigzag' when dense causal attention runs
  as ring attention (its work balanced), else 'natural' (halos)."""
  return "natural" if chunkable(cfg) else "zigzag"


def logical_axes() -> dict[str, sharding.Axis]:
  """Every logical parameter axis: the decoder's and each model's own (what `mesh.rules` may name).
  Two models declaring one name must mean the same axis."""
  axes = dict(sharding.SHARED_AXES)
  for name, entry in REGISTRY.items():
    for axis, spec in entry.logical_axes.items():
      if axes.setdefault(axis, spec) != spec:
        raise ValueError(f"models.REGISTRY[{name!r}] declares logical axis {axis!r} as {spec}, "
                         f"already declared as {axes[axis]}: give it another name")
  return axes


def validate(cfg: ml_collections.ConfigDict, platform: str | None = None) -> None:
  """Checks the fields every model shares, then the model's own, then that the attention backend
  runs its patterns on `platform` (default: jax's backend); raises ConfigError. The section has
  every field (`config_base.fill_defaults` fills an older one at the door)."""
  require(cfg.name in REGISTRY, "model.name", cfg.name, "is not a known model",
          f"use one of {', '.join(sorted(REGISTRY))}")
  for field in ("vocab_size", "seq_len", "d_model", "num_layers", "num_heads", "mlp_ratio"):
    require_positive_int(f"model.{field}", cfg[field])
  require(cfg.d_model % cfg.num_heads == 0, "model.d_model", cfg.d_model,
          f"must be divisible by model.num_heads={cfg.num_heads}",
          f"set model.d_model to a multiple of {cfg.num_heads} or change model.num_heads")
  head_dim = cfg.d_model // cfg.num_heads
  require(cfg.position != "rope" or head_dim % 2 == 0, "model.d_model", cfg.d_model,
          f"gives an odd head width {head_dim}, which RoPE cannot rotate",
          "make model.d_model / model.num_heads even")
  require(0.0 <= cfg.dropout < 1.0, "model.dropout", cfg.dropout, "must be in [0, 1)",
          "set model.dropout to e.g. 0.0 or 0.1")
  require(cfg.position in ("rope", "learned"), "model.position", cfg.position,
          "is not a known position encoding", "use 'rope' or 'learned'")
  require(cfg.dtype in ("float32", "bfloat16"), "model.dtype", cfg.dtype,
          "is not a supported compute dtype", "use 'float32' (CPU) or 'bfloat16' (accelerators)")
  remat = cfg.remat
  require(remat in ("none", *decoder.REMAT_POLICIES), "model.remat", remat,
          "is not a rematerialization policy",
          "use 'none', 'block' (keep only block inputs) or 'dots' (also keep matmul outputs)")
  seq_chunk = cfg.seq_chunk
  require(isinstance(seq_chunk, int) and not isinstance(seq_chunk, bool) and seq_chunk >= 0,
          "model.seq_chunk", seq_chunk, "must be an integer >= 0 (0 = the whole window at once)",
          "set model.seq_chunk to e.g. 8192, or 0")
  REGISTRY[cfg.name].validate(cfg)
  if seq_chunk and seq_chunk < cfg.seq_len:
    _validate_seq_chunk(cfg, seq_chunk)
  validate_attention_impl(cfg, platform or jax.default_backend())


def validate_attention_impl(cfg: ml_collections.ConfigDict, platform: str) -> None:
  """`model.attention_impl` (and `kernel_interpret`) against the platform and the model's patterns."""
  impl, interpret = cfg.attention_impl, cfg.kernel_interpret
  known = (*backends.IMPLS, *backends.ALIASES)
  require(impl in known, "model.attention_impl", impl, "is not a known attention backend",
          f"use one of {', '.join(backends.IMPLS)}")
  require(isinstance(interpret, bool), "model.kernel_interpret", interpret, "must be True or False",
          "set model.kernel_interpret=False (True runs a kernel in Pallas interpret mode: tests)")
  reason = backends.check(impl, platform, interpret)
  require(reason is None, "model.attention_impl", impl, f"cannot run here: {reason}", "see above")
  reason = backends.check_installed(impl, platform)
  require(reason is None, "model.attention_impl", impl, "cannot call its kernels on this jax, so "
          f"every attention call would run on xla: {reason}",
          "set model.attention_impl='xla' (or 'auto'), or install a jax in jax_compat.JAX_REQUIREMENT")
  reason = backends.check_patterns(impl, platform, list(attention_patterns(cfg)))
  require(reason is None, "model.attention_impl", impl,
          f"cannot express {cfg.name}'s attention: {reason}", "set model.attention_impl accordingly")


def _validate_seq_chunk(cfg: ml_collections.ConfigDict, seq_chunk: int) -> None:
  require(REGISTRY[cfg.name].build is None and chunkable(cfg), "model.seq_chunk", seq_chunk,
          f"is not supported for model.name={cfg.name!r}: its queries see the whole window, so "
          "its blocks cannot run over chunks of it",
          "set model.seq_chunk=0 (model.remat and train.loss_chunk still cut its memory)")
  require(cfg.seq_len % seq_chunk == 0, "model.seq_chunk", seq_chunk,
          f"must divide data.seq_len={cfg.seq_len}", f"set model.seq_chunk to a divisor of {cfg.seq_len}")
  block = context_block(cfg)
  require(seq_chunk % block == 0, "model.seq_chunk", seq_chunk,
          f"is not a multiple of {cfg.name}'s attention block of {block} tokens (a chunk holds "
          "whole blocks)", f"set model.seq_chunk to a multiple of {block}")


def attention_backend_name(cfg: ml_collections.ConfigDict, platform: str) -> str:
  """The backend `model.attention_impl` means on `platform` (`auto` resolved)."""
  return backends.resolve(cfg.attention_impl, platform)


def validate_context(cfg: ml_collections.ConfigDict, context: int) -> None:
  """The model against `context` devices along the sequence (`mesh.context`); raises ConfigError."""
  if context == 1:
    return
  require(not cfg.seq_chunk or cfg.seq_chunk >= cfg.seq_len, "model.seq_chunk",
          cfg.seq_chunk, f"is not combined with mesh.context={context} (the ring ops "
          "already split the sequence over devices)", "set model.seq_chunk=0, or mesh.context=1")
  entry = REGISTRY[cfg.name]
  parallel = sorted(name for name, e in REGISTRY.items() if e.context_parallel)
  require(entry.context_parallel, "mesh.context", context,
          f"> 1 is not supported for model.name={cfg.name!r} ({entry.no_context_parallel})",
          f"set mesh.context=1 (and use mesh.data for more devices), or use "
          f"one of {', '.join(parallel)}")
  require(cfg.seq_len % context == 0, "mesh.context", context,
          f"must divide data.seq_len={cfg.seq_len} (each device holds seq_len / context tokens)",
          f"set mesh.context to a divisor of {cfg.seq_len}")
  chunk = cfg.seq_len // context
  block = context_block(cfg)
  require(chunk % block == 0, "mesh.context", context,
          f"leaves {chunk} tokens per device, not a multiple of {cfg.name}'s attention block of "
          f"{block} tokens (blocks may not straddle devices)",
          f"choose mesh.context so that data.seq_len / mesh.context is a multiple of {block}")
  if ring_layout(cfg) == "zigzag":
    require(cfg.seq_len % (2 * context) == 0, "mesh.context", context,
            f"needs data.seq_len={cfg.seq_len} divisible by 2 * mesh.context (the zig-zag "
            "layout gives each device two half-chunks)",
            f"set data.seq_len to a multiple of {2 * context}")


def context_size(mesh: jax.sharding.Mesh | None, axis_name: str = "context") -> int:
  """Devices along the sequence axis (1 without a mesh or without that axis)."""
  if mesh is None or axis_name not in mesh.axis_names:
    return 1
  return mesh.shape[axis_name]


def sequence_layout(cfg: ml_collections.ConfigDict, mesh: jax.sharding.Mesh | None) -> str:
  """The order the training loop feeds tokens in: 'natural', or 'zigzag' (`ops.ring`)."""
  return ring_layout(cfg) if context_size(mesh) > 1 else "natural"


_VALIDATED: set[tuple[str, str, int]] = set()  # (model section, platform, context) seen valid


def _validate_once(cfg: ml_collections.ConfigDict, platform: str, context: int) -> None:
  """`validate` and `validate_context`, once per distinct model section (a run builds its model
  several times: shapes, the train state, the evaluator, the sampler)."""
  key = (cfg.to_json_best_effort(sort_keys=True), platform, context)
  if key not in _VALIDATED:
    validate(cfg, platform)
    validate_context(cfg, context)
    _VALIDATED.add(key)


def create(cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs, mesh: jax.sharding.Mesh | None = None,
           platform: str | None = None) -> nnx.Module:
  """Builds the model `cfg.name`; its `__call__(tokens_BT)` returns logits `[B, T', V]`.

  `T'` is T for every causal LM; a model that predicts only some positions
  (Perceiver-AR) returns the last `T'` of them. Every parameter carries its
  logical axis names (`out_sharding` metadata, see `efficient_lm.sharding`);
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
  _validate_once(cfg, platform, context)
  route = Route(impl=attention_backend_name(cfg, platform), interpret=cfg.kernel_interpret,
                mesh=mesh if context > 1 else None, layout=sequence_layout(cfg, mesh))
  return _build(cfg, rngs, route)


def abstract_params(cfg: ml_collections.ConfigDict, platform: str | None = None):
  """The model's parameters as shapes with their logical axis names; nothing is allocated."""
  return nnx.state(nnx.eval_shape(lambda: create(cfg, rngs=nnx.Rngs(0), platform=platform)))


__all__ = ["ConfigError", "REGISTRY", "ModelEntry", "abstract_params", "attention_patterns",
           "chunkable", "context_block", "context_size", "create", "logical_axes", "ring_layout",
           "sequence_layout", "validate", "validate_context"]
