"""Model registry: `create(model_config, rngs=...)` builds the model named by `model.name`.

Each entry says how to build one layer's mixer, whether all layers are
identical (scanned) and which model-specific fields to validate. Adding a model
is adding an entry here and a module beside this one.
"""

import dataclasses
from typing import Callable

import jax
import ml_collections
from flax import nnx

from efficient_lm.models import bcmt
from efficient_lm.models import decoder
from efficient_lm.models import dense
from efficient_lm.models import ecp
from efficient_lm.models import perceiver_ar
from efficient_lm.models import pi_attention
from efficient_lm.validation import ConfigError, require, require_positive_int


@dataclasses.dataclass(frozen=True)
class ModelEntry:
  """How to build one model.

  Most models are the shared decoder with their own mixer: `make_mixer(cfg,
  layer, rngs)`, with `identical_layers(cfg)` saying whether the layers can be
  scanned. A model with another structure (Perceiver-AR) gives `build(cfg,
  rngs)` instead. Either way the module has `__call__(tokens_BT)`,
  `embed_tokens(tokens_BT)` and `decode(x_BTD)` (tests differentiate through it).
  """
  make_mixer: Callable[[ml_collections.ConfigDict, int, nnx.Rngs], nnx.Module] | None = None
  identical_layers: Callable[[ml_collections.ConfigDict], bool] = lambda cfg: True
  validate: Callable[[ml_collections.ConfigDict], None] = lambda cfg: None
  build: Callable[[ml_collections.ConfigDict, nnx.Rngs], nnx.Module] | None = None


REGISTRY: dict[str, ModelEntry] = {
    "dense": ModelEntry(make_mixer=dense.make_mixer),
    "ecp": ModelEntry(make_mixer=ecp.make_mixer, identical_layers=ecp.identical_layers,
                      validate=ecp.validate),
    **{name: ModelEntry(build=perceiver_ar.build, validate=perceiver_ar.validate)
       for name in perceiver_ar.VARIANTS},
    "bcmt": ModelEntry(make_mixer=bcmt.make_mixer, validate=bcmt.validate),
    "honly": ModelEntry(make_mixer=bcmt.make_honly_mixer, validate=bcmt.validate_honly),
    "pi_attention": ModelEntry(make_mixer=pi_attention.make_pi_mixer,
                               identical_layers=lambda cfg: cfg.period_schedule == "constant",
                               validate=pi_attention.validate_pi),
    "sliding_window": ModelEntry(make_mixer=pi_attention.make_sliding_window_mixer,
                                 validate=pi_attention.validate_sliding_window),
}


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Checks the fields every model shares, then the model's own; raises ConfigError."""
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
  REGISTRY[cfg.name].validate(cfg)


def create(cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs, mesh: jax.sharding.Mesh | None = None
           ) -> nnx.Module:
  """Builds the model `cfg.name`; its `__call__(tokens_BT)` returns logits `[B, T', V]`.

  `T'` is T for every causal LM; a model that predicts only some positions
  (Perceiver-AR) returns the last `T'` of them. `mesh` is accepted for the
  context-parallel ops; parameters are replicated.
  """
  del mesh  # parameters are replicated; the ops take the mesh when sharded
  validate(cfg)
  entry = REGISTRY[cfg.name]
  if entry.build is not None:
    return entry.build(cfg, rngs)
  return decoder.Decoder(cfg, lambda layer, rngs: entry.make_mixer(cfg, layer, rngs),
                         identical_layers=entry.identical_layers(cfg), rngs=rngs)


__all__ = ["ConfigError", "REGISTRY", "ModelEntry", "create", "validate"]
