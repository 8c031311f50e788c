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
import ml_collections
from flax import nnx

from efficient_lm.models import layers
from efficient_lm.ops import attention
from efficient_lm.validation import require, require_positive_int

PERIOD_SCHEDULES = ("constant", "doubling")


def layer_period(cfg: ml_collections.ConfigDict, layer: int) -> int:
  return cfg.period * 2 ** layer if cfg.period_schedule == "doubling" else cfg.period


class PiMixer(nnx.Module):

  def __init__(self, cfg: ml_collections.ConfigDict, *, period: int, rngs: nnx.Rngs):
    dtype = layers.dtype_of(cfg.dtype)
    self.window, self.period, self.num_skips = cfg.window, period, cfg.num_skips
    self.attn = layers.SelfAttention(cfg.d_model, cfg.num_heads, op=None,
                                     use_rope=cfg.position == "rope", rope_base=cfg.rope_base,
                                     dtype=dtype, rngs=rngs)
    self.gate_in = nnx.Linear(cfg.d_model, cfg.gate_hidden, dtype=dtype, rngs=rngs)
    self.gate_out = nnx.Linear(cfg.gate_hidden, cfg.num_heads, dtype=dtype, rngs=rngs)

  def gate(self, x_BTD: jax.Array) -> jax.Array:
    """The prior weight of the local part, per token and head, in (0, 1)."""
    return jax.nn.sigmoid(self.gate_out(jax.nn.gelu(self.gate_in(x_BTD))))

  def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array) -> jax.Array:
    B, T, D = x_BTD.shape
    q_BTHK, k_BTHK, v_BTHK = self.attn.project(x_BTD, positions_BT)
    o_BTHK = attention.pi_attention(q_BTHK, k_BTHK, v_BTHK, self.gate(x_BTD), window=self.window,
                                    period=self.period, num_skips=self.num_skips)
    return self.attn.out(o_BTHK.reshape(B, T, D))


def make_pi_mixer(cfg: ml_collections.ConfigDict, layer: int, rngs: nnx.Rngs) -> nnx.Module:
  return PiMixer(cfg, period=layer_period(cfg, layer), rngs=rngs)


def make_sliding_window_mixer(cfg: ml_collections.ConfigDict, layer: int, rngs: nnx.Rngs
                              ) -> nnx.Module:
  del layer
  window = cfg.window

  def op(q_BTHK, k_BTHK, v_BTHK):
    return attention.sliding_window_attention(q_BTHK, k_BTHK, v_BTHK, window=window)

  return layers.SelfAttention(cfg.d_model, cfg.num_heads, op, use_rope=cfg.position == "rope",
                              rope_base=cfg.rope_base, dtype=layers.dtype_of(cfg.dtype), rngs=rngs)


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
