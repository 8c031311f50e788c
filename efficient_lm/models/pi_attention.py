"""π-Attention (docs/architecture.md, "π-Attention") and its baseline, sliding-window attention.

π mixer: q, k, v; a per-token, per-head gate from a small MLP on the token's
representation; `ops.attention.pi_attention` (local window + periodic skips,
log-prior fusion in one softmax); output projection. The baseline is the same
window with no skips and no gate ("RingAttention" in the paper's tables).

Per-layer settings: `model.window`, `model.period` and `model.num_skips` are
scalars; `model.period_schedule='doubling'` gives layer l the period
`period * 2**l` (the growing-period reading of the paper's O(k n_l + P log n_l)
receptive field), `'constant'` the same period everywhere. Layers whose
settings differ are unrolled; identical ones are scanned.
"""

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from efficient_lm import sharding
from efficient_lm.models import layers
from efficient_lm.ops import attention
from efficient_lm.ops import op_set
from efficient_lm.ops import precision
from efficient_lm.ops.pattern import Pattern
from efficient_lm.validation import require, require_positive_int

PERIOD_SCHEDULES = ("constant", "doubling")
GATES = ("learned", "fixed")  # model.gate: the gate MLP, or g = 0.5 everywhere (no parameters)
LOGICAL_AXES = {"gate_hidden": sharding.Axis("model.gate_hidden")}  # the gate MLP's hidden width


def layer_period(cfg: ml_collections.ConfigDict, layer: int) -> int:
  return cfg.period * 2 ** layer if cfg.period_schedule == "doubling" else cfg.period


class LocalMixer(nnx.Module):
  """The π mixer (`gated=True`) and the sliding-window one (`gated=False`, no skips).

  Cached decoding keeps a ring buffer of the last max(window, num_skips * period + 1)
  keys and values per layer (the window and the farthest skip bound what any
  later token reads): memory independent of the context length, not of the
  period (with a doubling period deeper layers hold more).
  """

  def __init__(self, cfg: ml_collections.ConfigDict, *, window: int, period: int = 1,
               num_skips: int = 0, gated: bool, rngs: nnx.Rngs,
               ops: op_set.OpSet = op_set.SINGLE_DEVICE):
    dtype = layers.dtype_of(cfg.dtype)
    self.ops = ops
    self.window, self.period, self.num_skips, self.gated = window, period, num_skips, gated
    self.num_heads = cfg.num_heads
    self.attn = layers.SelfAttention(cfg.d_model, cfg.num_heads, op=None,
                                     use_rope=cfg.position == "rope", rope_base=cfg.rope_base,
                                     dtype=dtype, rngs=rngs, attend=ops.attend)
    self.gate_in = nnx.data(None)
    self.gate_out = nnx.data(None)
    self.fixed_gate = gated and cfg.get("gate", "learned") == "fixed"
    if gated and not self.fixed_gate:
      self.gate_in = nnx.Linear(cfg.d_model, cfg.gate_hidden, dtype=dtype, rngs=rngs,
                                kernel_metadata=layers.axes("embed", "gate_hidden"),
                                bias_metadata=layers.axes("gate_hidden"))
      self.gate_out = nnx.Linear(cfg.gate_hidden, cfg.num_heads, dtype=dtype, rngs=rngs,
                                 kernel_metadata=layers.axes("gate_hidden", "heads"),
                                 bias_metadata=layers.axes("heads"))

  def gate_logits(self, x_BTD: jax.Array) -> jax.Array:
    """The logit z of the local part's prior weight g = sigmoid(z), per token and head, float32:
    the priors are log_sigmoid(+-z), exact at any z (a sigmoid rounds g to 1 from z ~ 17 in
    float32, from z ~ 6 in bfloat16). The gate MLP's hidden layer runs in the compute dtype.
    `model.gate='fixed'`: z = 0 (g = 0.5), the window and the skips weighed equally."""
    if self.fixed_gate:
      return jnp.zeros((*x_BTD.shape[:2], self.num_heads), jnp.float32)
    hidden_BTG = jax.nn.gelu(self.gate_in(x_BTD))
    kernel_GH = self.gate_out.kernel[...].astype(hidden_BTG.dtype)
    return (precision.einsum_f32("btg,gh->bth", hidden_BTG, kernel_GH)
            + self.gate_out.bias[...].astype(jnp.float32))

  def gate(self, x_BTD: jax.Array) -> jax.Array:
    """The prior weight of the local part, per token and head, in (0, 1)."""
    return jax.nn.sigmoid(self.gate_logits(x_BTD))

  def priors(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(local, skip) log-priors `[B, T, H]`, float32: log g and log(1 - g)."""
    return attention.gate_priors(gate_logits_BTH=self.gate_logits(x_BTD))

  def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array) -> jax.Array:
    return self.attend(x_BTD, *self.attn.project(x_BTD, positions_BT))

  def attend(self, x_BTD, q_BTHK, k_BTHK, v_BTHK) -> jax.Array:
    B, T, D = x_BTD.shape
    if self.gated:
      o_BTHK = self.ops.pi_attention(q_BTHK, k_BTHK, v_BTHK, None,
                                     gate_logits_BTH=self.gate_logits(x_BTD), window=self.window,
                                     period=self.period, num_skips=self.num_skips)
    else:
      o_BTHK = self.ops.sliding_window_attention(q_BTHK, k_BTHK, v_BTHK, window=self.window)
    return self.attn.out(o_BTHK.reshape(B, T, D))

  # Sequence-chunked blocks (`models/chunking.py`).

  @property
  def chunk_pattern(self) -> Pattern:
    return self.pattern

  def keys_values(self, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    return self.attn.keys_values(x_BTD, positions_BT)

  def attend_chunk(self, x_BCD, positions_BC, k_BWHK, v_BWHK, q_start, k_offset, q_align,
                   context=None):
    del context
    priors = {}
    if self.gated:
      priors = dict(zip(("local_prior", "skip_prior"), self.priors(x_BCD)))
    return self.attn.attend_window(self.attn.queries(x_BCD, positions_BC), k_BWHK, v_BWHK,
                                   q_start, k_offset, q_align, self.pattern, **priors)

  # Cached decoding: a ring buffer indexed by position % span.

  @property
  def pattern(self) -> Pattern:
    """Who sees whom: π's window and skips (any length), or the window alone."""
    if self.gated:
      return Pattern.pi(self.window, self.period, self.num_skips)
    return Pattern.sliding(self.window)

  @property
  def skip_offsets(self) -> list[int]:
    return list(self.pattern.skips)

  @property
  def cache_span(self) -> int:
    """Keys any future token can still attend to: its window and its farthest skip."""
    return self.pattern.reach + 1

  def init_cache(self, batch_size: int, max_len: int = 0) -> dict:
    """`max_len` is not needed: the span is fixed by the window and the skips."""
    del max_len
    D = self.attn.out.in_features
    return layers.kv_cache_init(batch_size, self.cache_span, self.num_heads, D // self.num_heads,
                               self.attn.qkv.dtype or jnp.float32)

  def prefill(self, x_BTD: jax.Array, positions_BT: jax.Array, cache: dict
              ) -> tuple[jax.Array, dict]:
    q_BTHK, k_BTHK, v_BTHK = self.attn.project(x_BTD, positions_BT)
    y_BTD = self.attend(x_BTD, q_BTHK, k_BTHK, v_BTHK)
    return y_BTD, layers.kv_cache_write(cache, k_BTHK, v_BTHK, positions_BT[0])

  def extend(self, x_BCD: jax.Array, start: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    B, C, D = x_BCD.shape
    pos_C, positions_BC = layers.chunk_positions(start, B, C)
    q_BCHK, k_BCHK, v_BCHK = self.attn.project(x_BCD, positions_BC)
    k_NSK, v_NSK, pos_S, cache = layers.kv_cache_extend(cache, k_BCHK, v_BCHK, pos_C)
    priors = {}
    if self.gated:  # the same log-priors as the parallel pass
      priors = dict(zip(("local_prior_BCH", "skip_prior_BCH"), self.priors(x_BCD)))
    o_BCHK = layers.cached_attention(q_BCHK, k_NSK, v_NSK, pos_S, self.pattern, pos_C[0], **priors)
    return self.attn.out(o_BCHK.reshape(B, C, D)), cache


def make_pi_mixer(cfg: ml_collections.ConfigDict, layer: int, rngs: nnx.Rngs, *,
                  ops: op_set.OpSet = op_set.SINGLE_DEVICE) -> nnx.Module:
  return LocalMixer(cfg, window=cfg.window, period=layer_period(cfg, layer),
                    num_skips=cfg.num_skips, gated=True, rngs=rngs, ops=ops)


def make_sliding_window_mixer(cfg: ml_collections.ConfigDict, layer: int, rngs: nnx.Rngs, *,
                              ops: op_set.OpSet = op_set.SINGLE_DEVICE) -> nnx.Module:
  del layer
  return LocalMixer(cfg, window=cfg.window, gated=False, rngs=rngs, ops=ops)


def pi_patterns(cfg: ml_collections.ConfigDict) -> list[Pattern]:
  """Every layer's π pattern (the window and its layer's skips)."""
  return [Pattern.pi(cfg.window, layer_period(cfg, layer), cfg.num_skips)
          for layer in range(cfg.num_layers)]


def validate_sliding_window(cfg: ml_collections.ConfigDict) -> None:
  require("window" in cfg, "model.window", None, "is missing",
          "add model.window (the local window, e.g. 128) to the config")
  require_positive_int("model.window", cfg.window)


def validate_pi(cfg: ml_collections.ConfigDict) -> None:
  validate_sliding_window(cfg)
  for field in ("period", "num_skips", "period_schedule", "gate_hidden"):
    require(field in cfg, f"model.{field}", None, "is missing",
            f"start from configs/pi_attention.py, which defines model.{field}")
  require_positive_int("model.period", cfg.period)
  require(isinstance(cfg.num_skips, int) and cfg.num_skips >= 0, "model.num_skips", cfg.num_skips,
          "must be a non-negative integer", "set model.num_skips to e.g. 4 (0 = window only)")
  require(cfg.period_schedule in PERIOD_SCHEDULES, "model.period_schedule", cfg.period_schedule,
          "is not a known schedule", f"use one of {', '.join(PERIOD_SCHEDULES)}")
  require_positive_int("model.gate_hidden", cfg.gate_hidden)
  require(cfg.get("gate", "learned") in GATES, "model.gate", cfg.get("gate"), "is not a known gate",
          "use 'learned' (the gate MLP) or 'fixed' (g = 0.5: window and skips weighed equally)")
