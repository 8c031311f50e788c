"""Attention ops on `[B, T, H, K]` arrays (the layout of `jax.nn.dot_product_attention`).

`causal_attention` is the dense O(T^2) reference; the efficient ops of later
modules are tested against plain masked references built like it.
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops import blockwise


def _default_scale(q_BTHK: jax.Array, scale: float | None) -> float:
  return q_BTHK.shape[-1] ** -0.5 if scale is None else scale


def causal_attention(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    *,
    scale: float | None = None,
) -> jax.Array:
  """Dense causal softmax attention: token i attends to every j <= i.

  Builds the `[T, T]` score matrix: O(T^2) time and memory. This is the dense
  baseline and the reference the efficient ops are compared with. Scores and
  softmax are computed in float32 whatever the input dtype.
  """
  T = q_BTHK.shape[1]
  scale = _default_scale(q_BTHK, scale)
  scores_BHTT = jnp.einsum("bqhk,bthk->bhqt", q_BTHK, k_BTHK,
                           preferred_element_type=jnp.float32) * scale
  causal_TT = jnp.tril(jnp.ones((T, T), dtype=bool))
  scores_BHTT = jnp.where(causal_TT, scores_BHTT, -jnp.inf)
  probs_BHTT = jax.nn.softmax(scores_BHTT, axis=-1)
  return jnp.einsum("bhqt,bthk->bqhk", probs_BHTT.astype(v_BTHK.dtype), v_BTHK)


def _check_positive(name: str, value: int) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name}={value!r} must be a positive integer")


def block_local_attention(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    *,
    block_size: int,
    lookback: int = 0,
    scale: float | None = None,
) -> jax.Array:
  """Token i of block b = i // block_size attends to every j <= i with b - lookback <= j // block_size.

  lookback=0 is BCMT's local attention, lookback=1 ECP's pair of segments. Any T
  (padded internally). Cost and memory O(T * (lookback + 1) * block_size).
  """
  _check_positive("block_size", block_size)
  if not isinstance(lookback, int) or lookback < 0:
    raise ValueError(f"lookback={lookback!r} must be a non-negative integer")
  T = q_BTHK.shape[1]
  if T <= block_size:  # one block: plain causal attention over T <= block_size tokens
    return blockwise.blockwise_attention(q_BTHK, k_BTHK, v_BTHK, block_size=T, lookback=0,
                                         scale=scale)
  return blockwise.blockwise_attention(q_BTHK, k_BTHK, v_BTHK, block_size=block_size,
                                       lookback=lookback, scale=scale)


def _window_blocks(T: int, window: int) -> dict:
  """Blocks of `window` tokens with one block of lookback cover i - window < j <= i."""
  if window >= T:
    return dict(block_size=T, lookback=0, window=None)
  return dict(block_size=window, lookback=1, window=window)


def sliding_window_attention(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    *,
    window: int,
    scale: float | None = None,
) -> jax.Array:
  """Token i attends to j with i - window < j <= i. Cost and memory O(T * window)."""
  _check_positive("window", window)
  return blockwise.blockwise_attention(q_BTHK, k_BTHK, v_BTHK, scale=scale,
                                       **_window_blocks(q_BTHK.shape[1], window))


GATE_EPS = 1e-6


def skip_offsets(T: int, *, window: int, period: int, num_skips: int) -> list[int]:
  """The skip distances m * period (m = 1..num_skips) that can ever be used at length T.

  A skip inside the window (m * period < window) is already a local key; one at
  or beyond T never lands on a position.
  """
  return [m * period for m in range(1, num_skips + 1) if window <= m * period < T]


def shift_right(x_BT: jax.Array, distance: int) -> jax.Array:
  """x[:, i - distance] at position i (zeros before the start): a strided slice, no gather."""
  T = x_BT.shape[1]
  pad = [(0, 0), (distance, 0)] + [(0, 0)] * (x_BT.ndim - 2)
  return jnp.pad(x_BT, pad)[:, :T]


def gated_skip_logits(q_BTHK: jax.Array, skip_k_BTSHK: jax.Array, gate_BTH: jax.Array,
                      present_TS: jax.Array, scale: float) -> jax.Array:
  """Scaled skip logits plus log(1 - gate) (gate already clamped); `MASKED` where a skip is absent."""
  skip_logits_BTHS = jnp.einsum("bthk,btshk->bths", q_BTHK, skip_k_BTSHK,
                                preferred_element_type=jnp.float32) * scale
  skip_logits_BTHS = skip_logits_BTHS + jnp.log1p(-gate_BTH)[..., None]
  return jnp.where(present_TS[None, :, None, :], skip_logits_BTHS, blockwise.MASKED)


def pi_attention(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    gate_BTH: jax.Array,
    *,
    window: int,
    period: int,
    num_skips: int,
    scale: float | None = None,
) -> jax.Array:
  """π-Attention: the causal window plus periodic skips, one softmax over their union.

  Token i attends to {j : i - window < j <= i} and to the skips i - m * period
  (m = 1..num_skips, i - m * period >= 0, not inside the window). `log(gate)` is
  added to every local logit and `log(1 - gate)` to every skip logit; the gate
  is clamped to [1e-6, 1 - 1e-6]. Cost O(T * (window + num_skips)): a blocked
  local band, the skip keys gathered by shifted (strided) slices, and the two
  parts fused by one log-sum-exp.
  """
  _check_positive("window", window)
  _check_positive("period", period)
  if not isinstance(num_skips, int) or num_skips < 0:
    raise ValueError(f"num_skips={num_skips!r} must be a non-negative integer")
  B, T, H, K = q_BTHK.shape
  scale = K ** -0.5 if scale is None else scale
  gate_BTH = jnp.clip(gate_BTH.astype(jnp.float32), GATE_EPS, 1.0 - GATE_EPS)
  offsets = skip_offsets(T, window=window, period=period, num_skips=num_skips)
  blocks = _window_blocks(T, window)
  if not offsets:  # no skip ever lands: log(gate) shifts every logit of a row equally
    return blockwise.blockwise_attention(q_BTHK, k_BTHK, v_BTHK, scale=scale, **blocks)
  skip_k_BTSHK = jnp.stack([shift_right(k_BTHK, d) for d in offsets], axis=2)
  skip_v_BTSHK = jnp.stack([shift_right(v_BTHK, d) for d in offsets], axis=2)
  present_TS = jnp.arange(T)[:, None] >= jnp.asarray(offsets)[None, :]
  skip_logits_BTHS = gated_skip_logits(q_BTHK, skip_k_BTSHK, gate_BTH, present_TS, scale)
  return blockwise.blockwise_attention(
      q_BTHK, k_BTHK, v_BTHK, scale=scale, local_bias_BTH=jnp.log(gate_BTH),
      extra_logits_BTHS=skip_logits_BTHS, extra_v_BTSHK=skip_v_BTSHK, **blocks)
