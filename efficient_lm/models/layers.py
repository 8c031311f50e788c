"""Building blocks shared by every model: projections, RoPE, MLP, dropout."""

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

AttentionOp = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def dtype_of(name: str) -> jnp.dtype:
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
  """Inverted dropout; the identity when `key` is None (eval) or `rate` is 0."""
  if key is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def rope(x_BTHK: jax.Array, positions_BT: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding (rotate-half form) at the given positions."""
  K = x_BTHK.shape[-1]
  inv_freq_F = base ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
  angles_BTF = positions_BT[..., None].astype(jnp.float32) * inv_freq_F
  sin_BT1F = jnp.sin(angles_BTF)[:, :, None, :]
  cos_BT1F = jnp.cos(angles_BTF)[:, :, None, :]
  x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos_BT1F - x2 * sin_BT1F, x2 * cos_BT1F + x1 * sin_BT1F], axis=-1)
  return rotated.astype(x_BTHK.dtype)


def attend_cached(q_B1HK: jax.Array, k_BSHK: jax.Array, v_BSHK: jax.Array, valid_S: jax.Array,
                  *, scale: float | None = None, bias_BHS: jax.Array | None = None) -> jax.Array:
  """One query per sequence over S cached keys, of which `valid_S` are visible (decoding).

  `bias_BHS` is added to the logits (π-Attention's log-prior gate).
  """
  scale = q_B1HK.shape[-1] ** -0.5 if scale is None else scale
  logits_BHS = jnp.einsum("bhk,bshk->bhs", q_B1HK[:, 0], k_BSHK,
                          preferred_element_type=jnp.float32) * scale
  if bias_BHS is not None:
    logits_BHS = logits_BHS + bias_BHS
  probs_BHS = jax.nn.softmax(jnp.where(valid_S, logits_BHS, -jnp.inf), axis=-1)
  return jnp.einsum("bhs,bshk->bhk", probs_BHS.astype(v_BSHK.dtype), v_BSHK)[:, None]


class Mlp(nnx.Module):
  """D -> F -> D with GELU, F = mlp_ratio * D."""

  def __init__(self, d_model: int, mlp_ratio: int, *, dtype, rngs: nnx.Rngs):
    hidden = mlp_ratio * d_model
    self.up = nnx.Linear(d_model, hidden, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(hidden, d_model, dtype=dtype, rngs=rngs)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    return self.down(jax.nn.gelu(self.up(x_BTD)))


class SelfAttention(nnx.Module):
  """q, k, v projections, RoPE (optional), an attention op, output projection.

  The op is any `(q_BTHK, k_BTHK, v_BTHK) -> o_BTHK` function: dense causal
  attention for the baseline, a windowed or blockwise op for the efficient
  models. Models whose mixer needs more (a gate, a memory) wrap this module,
  call `project` and `out` themselves and may pass `op=None`.
  """

  def __init__(self, d_model: int, num_heads: int, op: AttentionOp | None, *, use_rope: bool,
               rope_base: float, dtype, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.op = op
    self.use_rope = use_rope
    self.rope_base = rope_base
    self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(d_model, d_model, use_bias=False, dtype=dtype, rngs=rngs)

  def project(self, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, ...]:
    B, T, D = x_BTD.shape
    qkv_BT3HK = self.qkv(x_BTD).reshape(B, T, 3, self.num_heads, D // self.num_heads)
    q_BTHK, k_BTHK, v_BTHK = (qkv_BT3HK[:, :, i] for i in range(3))
    if self.use_rope:
      q_BTHK = rope(q_BTHK, positions_BT, self.rope_base)
      k_BTHK = rope(k_BTHK, positions_BT, self.rope_base)
    return q_BTHK, k_BTHK, v_BTHK

  def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array) -> jax.Array:
    B, T, D = x_BTD.shape
    o_BTHK = self.op(*self.project(x_BTD, positions_BT))
    return self.out(o_BTHK.reshape(B, T, D))
