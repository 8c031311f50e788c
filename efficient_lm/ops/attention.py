"""Attention ops on `[B, T, H, K]` arrays (the layout of `jax.nn.dot_product_attention`).

Every op is the one blockwise core (`ops.core.attend`) with a `Pattern`:
O(T) memory, a flash backward. `causal_attention(impl="reference")` keeps the
dense O(T^2) einsum as the reference the tests compare with.
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops import core
from efficient_lm.ops.pattern import Pattern

CAUSAL_IMPLS = ("flash", "reference", "cudnn")


def _default_scale(q_BTHK: jax.Array, scale: float | None) -> float:
  return q_BTHK.shape[-1] ** -0.5 if scale is None else scale


def reference_causal_attention(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *,
                               scale: float | None = None) -> jax.Array:
  """Dense causal softmax attention through the full `[T, T]` score matrix: O(T^2) time and memory.

  Scores and softmax in float32 whatever the input dtype.
  """
  T = q_BTHK.shape[1]
  scale = _default_scale(q_BTHK, scale)
  scores_BHTT = jnp.einsum("bqhk,bthk->bhqt", q_BTHK, k_BTHK,
                           preferred_element_type=jnp.float32) * scale
  causal_TT = jnp.tril(jnp.ones((T, T), dtype=bool))
  scores_BHTT = jnp.where(causal_TT, scores_BHTT, -jnp.inf)
  probs_BHTT = jax.nn.softmax(scores_BHTT, axis=-1)
  return jnp.einsum("bhqt,bthk->bqhk", probs_BHTT.astype(v_BTHK.dtype), v_BTHK)


def check_causal_impl(impl: str, dtype) -> None:
  """Raises ValueError unless `impl` can run here on inputs of `dtype`."""
  if impl not in CAUSAL_IMPLS:
    raise ValueError(f"impl={impl!r} must be one of {CAUSAL_IMPLS}")
  if impl == "cudnn":
    if jax.default_backend() != "gpu":
      raise ValueError(f"impl='cudnn' needs a GPU backend (this one is {jax.default_backend()!r}); "
                       "use impl='flash'")
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
      raise ValueError(f"impl='cudnn' needs bfloat16 or float16 inputs, got {jnp.dtype(dtype)}; "
                       "cast q, k, v (model.dtype='bfloat16') or use impl='flash'")


def causal_attention(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    *,
    scale: float | None = None,
    impl: str = "flash",
) -> jax.Array:
  """Causal softmax attention: token i attends to every j <= i.

  `impl="flash"`: the blockwise core over all past key blocks (O(T) memory,
  O(T^2) time, future blocks skipped). `"reference"`: the dense `[T, T]`
  einsum (O(T^2) memory; the tests' reference). `"cudnn"`:
  `jax.nn.dot_product_attention(..., implementation="cudnn")`, GPU only, with
  bfloat16/float16 inputs.
  """
  check_causal_impl(impl, q_BTHK.dtype)
  if impl == "reference":
    return reference_causal_attention(q_BTHK, k_BTHK, v_BTHK, scale=scale)
  if impl == "cudnn":
    return jax.nn.dot_product_attention(q_BTHK, k_BTHK, v_BTHK, scale=scale, is_causal=True,
                                        implementation="cudnn")
  return core.attend(q_BTHK, k_BTHK, v_BTHK, Pattern.dense(), scale=scale)[0]


def _check_positive(name: str, value: int) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name}={value!r} must be a positive integer")


def _check_lookback(lookback: int) -> None:
  if not isinstance(lookback, int) or isinstance(lookback, bool) or lookback < 0:
    raise ValueError(f"lookback={lookback!r} must be a non-negative integer")


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

  lookback=0 is BCMT's local attention, lookback=1 ECP's pair of segments. Any
  T. Cost O(T * (lookback + 1) * block_size), memory O(T).
  """
  _check_positive("block_size", block_size)
  _check_lookback(lookback)
  return core.attend(q_BTHK, k_BTHK, v_BTHK, Pattern.blocks(block_size, lookback), scale=scale)[0]


def sliding_window_attention(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    *,
    window: int,
    scale: float | None = None,
) -> jax.Array:
  """Token i attends to j with i - window < j <= i. Cost O(T * window), memory O(T)."""
  _check_positive("window", window)
  return core.attend(q_BTHK, k_BTHK, v_BTHK, Pattern.sliding(window), scale=scale)[0]


GATE_EPS = 1e-6


def skip_offsets(T: int, *, window: int, period: int, num_skips: int) -> list[int]:
  """The skip distances m * period (m = 1..num_skips) that can ever be used at length T.

  A skip inside the window (m * period < window) is already a local key; one at
  or beyond T never lands on a position.
  """
  return list(Pattern.pi(window, period, num_skips, seq_len=T).skips)


def shift_right(x_BT: jax.Array, distance: int) -> jax.Array:
  """x[:, i - distance] at position i (zeros before the start): a strided slice, no gather."""
  T = x_BT.shape[1]
  pad = [(0, 0), (distance, 0)] + [(0, 0)] * (x_BT.ndim - 2)
  return jnp.pad(x_BT, pad)[:, :T]


def gate_priors(gate_BTH: jax.Array | None = None, gate_logits_BTH: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
  """π's log-priors (local, skip), float32: log g and log(1 - g).

  From the gate g (clamped to [1e-6, 1 - 1e-6]) or, exactly at any logit z,
  from `gate_logits_BTH`: log_sigmoid(z) and log_sigmoid(-z). Exactly one of
  the two must be given.
  """
  if (gate_BTH is None) == (gate_logits_BTH is None):
    raise ValueError("pass exactly one of gate_BTH (the gate in (0, 1)) and gate_logits_BTH "
                     "(its logit; exact near 0 and 1)")
  if gate_logits_BTH is not None:
    z_BTH = gate_logits_BTH.astype(jnp.float32)
    return jax.nn.log_sigmoid(z_BTH), jax.nn.log_sigmoid(-z_BTH)
  g_BTH = jnp.clip(gate_BTH.astype(jnp.float32), GATE_EPS, 1.0 - GATE_EPS)
  return jnp.log(g_BTH), jnp.log1p(-g_BTH)


def check_pi_settings(window: int, period: int, num_skips: int) -> None:
  _check_positive("window", window)
  _check_positive("period", period)
  if not isinstance(num_skips, int) or isinstance(num_skips, bool) or num_skips < 0:
    raise ValueError(f"num_skips={num_skips!r} must be a non-negative integer")


def pi_attention(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    gate_BTH: jax.Array | None = None,
    *,
    window: int,
    period: int,
    num_skips: int,
    scale: float | None = None,
    gate_logits_BTH: jax.Array | None = None,
) -> jax.Array:
  """π-Attention: the causal window plus periodic skips, one softmax over their union.

  Token i attends to {j : i - window < j <= i} and to the skips i - m * period
  (m = 1..num_skips, i - m * period >= 0, not inside the window). log(g) is
  added to every local logit and log(1 - g) to every skip logit, with the gate
  g given as `gate_BTH` (clamped to [1e-6, 1 - 1e-6]) or as its logit
  `gate_logits_BTH` (exact: log_sigmoid(+-logit)); exactly one of them. Cost
  O(T * (window + num_skips)): the core's banded window plus the skip keys read
  as shifted slices.
  """
  check_pi_settings(window, period, num_skips)
  local_BTH, skip_BTH = gate_priors(gate_BTH, gate_logits_BTH)
  pattern = Pattern.pi(window, period, num_skips, seq_len=q_BTHK.shape[1])
  if not pattern.skips:  # no skip ever lands: log(g) shifts every logit of a row equally
    return core.attend(q_BTHK, k_BTHK, v_BTHK, pattern, scale=scale)[0]
  return core.attend(q_BTHK, k_BTHK, v_BTHK, pattern, scale=scale, local_prior=local_BTH,
                     skip_prior=skip_BTH)[0]
