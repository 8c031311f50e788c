"""Model registry: `create(model_config, rngs=...)` builds the model named by `model.name`.

Each entry says how to build one layer's mixer, whether all layers are
identical (scanned), which model-specific fields to validate and which logical
axes its own parameters carry. Adding a model is adding an entry here and a
module beside this one.
"""

import dataclasses
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
from efficient_lm.ops import op_set
from efficient_lm.ops.core import backends
from efficient_lm.ops.pattern import Pattern
from efficient_lm.validation import ConfigError, require, require_positive_int


@dataclasses.dataclass(frozen=True)
class ModelEntry:
  """How to build one model.

  Most models are the shared decoder with their own mixer: `make_mixer(cfg,
  layer, rngs)`, with `identical_layers(cfg)` saying whether the layers can be
  scanned. A model with another structure (Perceiver-AR) gives `build(cfg,
  rngs)` instead. Either way the module has `__call__(tokens_BT)`,
  `hidden(tokens_BT)`, `embed_tokens(tokens_BT)` and `from_embeddings(x_BTD)` (tests differentiate
  through it).

  Context parallelism (`mesh.context > 1`): `make_mixer` gets the ring ops as
  `ops=`; `context_block(cfg)` is (size, what) that each device's chunk of
  the sequence must be a multiple of; `layout` the sequence order the
  training loop feeds ('zigzag' balances dense ring attention); a model
  without ring ops has `context_parallel=False`.

  Sequence chunking (`model.seq_chunk`): a model whose queries see a bounded
  reach runs its blocks over chunks of the sequence; each chunk must be a
  multiple of `context_block(cfg)` too. One whose queries see the whole window
  (dense, Perceiver-AR's latents) has `chunkable=False`.

  `patterns(cfg)`: the attention patterns the model trains with, which the
  attention backend (`model.attention_impl`) must be able to express.

  `logical_axes`: the logical axis names its own parameters carry beyond the
  decoder's (`sharding.SHARED_AXES`), each with the config field that sets its
  size and its default `mesh.rules` entry.
  """
  make_mixer: Callable[[ml_collections.ConfigDict, int, nnx.Rngs], nnx.Module] | None = None
  identical_layers: Callable[[ml_collections.ConfigDict], bool] = lambda cfg: True
  validate: Callable[[ml_collections.ConfigDict], None] = lambda cfg: None
  build: Callable[[ml_collections.ConfigDict, nnx.Rngs], nnx.Module] | None = None
  context_parallel: bool = True
  context_block: Callable[[ml_collections.ConfigDict], tuple[int, str]] = lambda cfg: (1, "")
  layout: str = "natural"
  chunkable: bool = True
  patterns: Callable[[ml_collections.ConfigDict], list[Pattern]] = lambda cfg: [Pattern.dense()]
  no_context_parallel: str = "it has no ring version of its attention"  # why, if not supported
  logical_axes: Mapping[str, sharding.Axis] = dataclasses.field(default_factory=dict)


REGISTRY: dict[str, ModelEntry] = {
    "dense": ModelEntry(make_mixer=dense.make_mixer, layout="zigzag", chunkable=False),
    "ecp": ModelEntry(make_mixer=ecp.make_mixer, identical_layers=ecp.identical_layers,
                      validate=ecp.validate, context_block=lambda cfg: (
                          cfg.seq_len // cfg.num_segments,
                          "the segment length data.seq_len / model.num_segments"),
                      patterns=lambda cfg: [Pattern.blocks(cfg.seq_len // cfg.num_segments, 1)]),
    **{name: ModelEntry(build=perceiver_ar.build, validate=perceiver_ar.validate,
                        context_parallel=False, chunkable=False, patterns=perceiver_ar.patterns,
                        no_context_parallel="no ring version of its latent cross-attention",
                        logical_axes=perceiver_ar.LOGICAL_AXES)
       for name in perceiver_ar.VARIANTS},
    "bcmt": ModelEntry(make_mixer=bcmt.make_mixer, validate=bcmt.validate,
                       context_block=lambda cfg: (cfg.block_size, "model.block_size"),
                       patterns=lambda cfg: [Pattern.blocks(cfg.block_size)],
                       logical_axes=bcmt.LOGICAL_AXES),
    "honly": ModelEntry(make_mixer=bcmt.make_honly_mixer, validate=bcmt.validate_honly,
                        context_block=lambda cfg: (cfg.block_size, "model.block_size"),
                        patterns=lambda cfg: [Pattern.blocks(cfg.block_size)]),
    "pi_attention": ModelEntry(make_mixer=pi_attention.make_pi_mixer,
                               identical_layers=lambda cfg: cfg.period_schedule == "constant",
                               validate=pi_attention.validate_pi, patterns=pi_attention.pi_patterns,
                               logical_axes=pi_attention.LOGICAL_AXES),
    "sliding_window": ModelEntry(make_mixer=pi_attention.make_sliding_window_mixer,
                                 validate=pi_attention.validate_sliding_window,
                                 patterns=lambda cfg: [Pattern.sliding(cfg.window)]),
}


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
  reason = backends.check_patterns(impl, platform, REGISTRY[cfg.name].patterns(cfg))
  require(reason is None, "model.attention_impl", impl,
          f"cannot express {cfg.name}'s attention: {reason}", "set model.attention_impl accordingly")


def _validate_seq_chunk(cfg: ml_collections.ConfigDict, seq_chunk: int) -> None:
  entry = REGISTRY[cfg.name]
  require(entry.chunkable, "model.seq_chunk", seq_chunk,
          f"is not supported for model.name={cfg.name!r}: its queries see the whole window, so "
          "its blocks cannot run over chunks of it",
          "set model.seq_chunk=0 (model.remat and train.loss_chunk still cut its memory)")
  require(cfg.seq_len % seq_chunk == 0, "model.seq_chunk", seq_chunk,
          f"must divide data.seq_len={cfg.seq_len}", f"set model.seq_chunk to a divisor of {cfg.seq_len}")
  block, what = entry.context_block(cfg)
  require(seq_chunk % block == 0, "model.seq_chunk", seq_chunk,
          f"is not a multiple of {what} = {block} (a chunk holds whole blocks)",
          f"set model.seq_chunk to a multiple of {block}")


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
  block, what = entry.context_block(cfg)
  require(chunk % block == 0, "mesh.context", context,
          f"leaves {chunk} tokens per device, not a multiple of {what} = {block} (blocks may "
          "not straddle devices)", f"choose mesh.context so that data.seq_len / mesh.context "
          f"is a multiple of {block}")
  if entry.layout == "zigzag":
    require(cfg.seq_len % (2 * context) == 0, "mesh.context", context,
            f"needs data.seq_len={cfg.seq_len} divisible by 2 * mesh.context (the zig-zag "
            "layout gives each device two half-chunks)",
            f"set data.seq_len to a multiple of {2 * context}")


def sequence_layout(cfg: ml_collections.ConfigDict, mesh: jax.sharding.Mesh | None) -> str:
  """The order the training loop feeds tokens in: 'natural', or 'zigzag' (`ops.ring`)."""
  return REGISTRY[cfg.name].layout if op_set.context_size(mesh) > 1 else "natural"


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
  `mesh` whose `context` axis has several devices the mixers call the ring ops
  (`ops.op_set.for_mesh`); the batch must then come in
  `sequence_layout(cfg, mesh)` order with its positions. The attention runs on
  the backend `model.attention_impl` names for the platform of the mesh's
  devices (or `platform`, for a model built from shapes only).
  """
  if platform is None:
    platform = targets.platform_of(list(mesh.devices.flat) if mesh is not None else jax.devices())
  _validate_once(cfg, platform, op_set.context_size(mesh))
  entry = REGISTRY[cfg.name]
  ops = op_set.for_mesh(mesh, layout=sequence_layout(cfg, mesh),
                        impl=attention_backend_name(cfg, platform), interpret=cfg.kernel_interpret)
  if entry.build is not None:
    return entry.build(cfg, rngs, ops=ops)
  return decoder.Decoder(cfg, lambda layer, rngs: entry.make_mixer(cfg, layer, rngs, ops=ops),
                         identical_layers=entry.identical_layers(cfg), rngs=rngs)


def abstract_params(cfg: ml_collections.ConfigDict, platform: str | None = None):
  """The model's parameters as shapes with their logical axis names; nothing is allocated."""
  return nnx.state(nnx.eval_shape(lambda: create(cfg, rngs=nnx.Rngs(0), platform=platform)))


__all__ = ["ConfigError", "REGISTRY", "ModelEntry", "abstract_params", "create", "logical_axes",
           "sequence_layout", "validate", "validate_context"]
