"""π-Attention (SPEC section 7) and its baseline, sliding-window attention.

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

from efficient_lm.models import layers
from efficient_lm.ops import attention
from efficient_lm.validation import require, require_positive_int

PERIOD_SCHEDULES = ("constant", "doubling")


def layer_period(cfg: ml_collections.ConfigDict, layer: int) -> int:
  return cfg.period * 2 ** layer if cfg.period_schedule == "doubling" else cfg.period


class LocalMixer(nnx.Module):
  """The π mixer (`gated=True`) and the sliding-window one (`gated=False`, no skips).

  Cached decoding keeps a ring buffer of the last `window + num_skips * period`
  keys and values (the farthest skip's distance bounds it): memory independent
  of the context length.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, *, window: int, period: int = 1,
               num_skips: int = 0, gated: bool, rngs: nnx.Rngs):
    dtype = layers.dtype_of(cfg.dtype)
    self.window, self.period, self.num_skips, self.gated = window, period, num_skips, gated
    self.num_heads = cfg.num_heads
    self.attn = layers.SelfAttention(cfg.d_model, cfg.num_heads, op=None,
                                     use_rope=cfg.position == "rope", rope_base=cfg.rope_base,
                                     dtype=dtype, rngs=rngs)
    self.gate_in = nnx.data(None)
    self.gate_out = nnx.data(None)
    if gated:
      self.gate_in = nnx.Linear(cfg.d_model, cfg.gate_hidden, dtype=dtype, rngs=rngs)
      self.gate_out = nnx.Linear(cfg.gate_hidden, cfg.num_heads, dtype=dtype, rngs=rngs)

  def gate(self, x_BTD: jax.Array) -> jax.Array:
    """The prior weight of the local part, per token and head, in (0, 1)."""
    return jax.nn.sigmoid(self.gate_out(jax.nn.gelu(self.gate_in(x_BTD))))

  def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array) -> jax.Array:
    B, T, D = x_BTD.shape
    q_BTHK, k_BTHK, v_BTHK = self.attn.project(x_BTD, positions_BT)
    if self.gated:
      o_BTHK = attention.pi_attention(q_BTHK, k_BTHK, v_BTHK, self.gate(x_BTD), window=self.window,
                                      period=self.period, num_skips=self.num_skips)
    else:
      o_BTHK = attention.sliding_window_attention(q_BTHK, k_BTHK, v_BTHK, window=self.window)
    return self.attn.out(o_BTHK.reshape(B, T, D))

  # Cached decoding: a ring buffer indexed by position % span.

  @property
  def skip_offsets(self) -> list[int]:
    return [m * self.period for m in range(1, self.num_skips + 1) if m * self.period >= self.window]

  @property
  def cache_span(self) -> int:
    """Keys any future token can still attend to: its window and its farthest skip."""
    return max([self.window] + [d + 1 for d in self.skip_offsets])

  def init_cache(self, batch_size: int) -> dict:
    D = self.attn.out.in_features
    K = D // self.num_heads
    shape = (batch_size, self.cache_span, self.num_heads, K)
    return {"k": jnp.zeros(shape, self.attn.qkv.dtype or jnp.float32),
            "v": jnp.zeros(shape, self.attn.qkv.dtype or jnp.float32),
            "pos": jnp.full((self.cache_span,), -1, jnp.int32)}

  def step(self, x_B1D: jax.Array, position: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    B, _, D = x_B1D.shape
    q_B1HK, k_B1HK, v_B1HK = self.attn.project(x_B1D, jnp.full((B, 1), position, jnp.int32))
    slot = position % self.cache_span
    k_BSHK = jax.lax.dynamic_update_slice_in_dim(cache["k"], k_B1HK.astype(cache["k"].dtype), slot, 1)
    v_BSHK = jax.lax.dynamic_update_slice_in_dim(cache["v"], v_B1HK.astype(cache["v"].dtype), slot, 1)
    pos_S = jax.lax.dynamic_update_slice_in_dim(cache["pos"], position[None], slot, 0)
    distance_S = position - pos_S
    local_S = (pos_S >= 0) & (distance_S < self.window)
    visible_S, bias_BHS = local_S, None
    if self.gated:
      skip_S = jnp.zeros_like(local_S)
      for d in self.skip_offsets:
        skip_S |= (pos_S >= 0) & (distance_S == d)
      g_BH1 = jnp.clip(self.gate(x_B1D)[:, 0].astype(jnp.float32), attention.GATE_EPS,
                       1.0 - attention.GATE_EPS)[..., None]
      bias_BHS = jnp.where(local_S, jnp.log(g_BH1), jnp.log1p(-g_BH1))
      visible_S = local_S | skip_S
    o_B1HK = layers.attend_cached(q_B1HK, k_BSHK, v_BSHK, visible_S, bias_BHS=bias_BHS)
    return self.attn.out(o_B1HK.reshape(B, 1, D)), {"k": k_BSHK, "v": v_BSHK, "pos": pos_S}


def make_pi_mixer(cfg: ml_collections.ConfigDict, layer: int, rngs: nnx.Rngs) -> nnx.Module:
  return LocalMixer(cfg, window=cfg.window, period=layer_period(cfg, layer),
                    num_skips=cfg.num_skips, gated=True, rngs=rngs)


def make_sliding_window_mixer(cfg: ml_collections.ConfigDict, layer: int, rngs: nnx.Rngs
                              ) -> nnx.Module:
  del layer
  return LocalMixer(cfg, window=cfg.window, gated=False, rngs=rngs)


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
