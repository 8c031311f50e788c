"""Attention ops on `[B, T, H, K]` arrays (the layout of `jax.nn.dot_product_attention`).

Every op is the one attention core (`ops.core.attend`) with a `Pattern`, on
the backend `impl` names (`ops.core.backends`: 'xla', the blockwise loop
core, O(T) memory, a flash backward, by default; 'splash' on TPU, 'gpu' on
GPU; 'reference', the dense O(T^2) masked softmax the tests compare with).
A kernel backend off its hardware runs only with `interpret=True`.
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops import core
from efficient_lm.ops import precision
from efficient_lm.ops.core import backends
from efficient_lm.ops.pattern import Pattern

CAUSAL_IMPLS = ("flash", "reference", "cudnn")  # the dense model's earlier names ('flash' = 'xla')


def _default_scale(q_BTHK: jax.Array, scale: float | None) -> float:
  return q_BTHK.shape[-1] ** -0.5 if scale is None else scale


def reference_causal_attention(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *,
                               scale: float | None = None) -> jax.Array:
  """Dense causal softmax attention through the full `[T, T]` score matrix: O(T^2) time and memory.

  Scores and softmax in float32 whatever the input dtype.
  """
  T = q_BTHK.shape[1]
  scale = _default_scale(q_BTHK, scale)
  scores_BHTT = precision.einsum_f32("bqhk,bthk->bhqt", q_BTHK, k_BTHK) * scale
  causal_TT = jnp.tril(jnp.ones((T, T), dtype=bool))
  scores_BHTT = jnp.where(causal_TT, scores_BHTT, -jnp.inf)
  probs_BHTT = jax.nn.softmax(scores_BHTT, axis=-1)
  return jnp.einsum("bhqt,bthk->bqhk", probs_BHTT.astype(v_BTHK.dtype), v_BTHK)


def _attend(q_BTHK, k_BTHK, v_BTHK, pattern: Pattern, *, scale, impl: str, interpret: bool,
            **priors) -> jax.Array:
  return core.attend(q_BTHK, k_BTHK, v_BTHK, pattern, scale=scale, impl=backends.canonical(impl),
                     interpret=interpret, with_lse=False, **priors)[0]


def causal_attention(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    *,
    scale: float | None = None,
    impl: str = "xla",
    interpret: bool = False,
) -> jax.Array:
  """Causal softmax attention: token i attends to every j <= i.

  `impl="xla"` (or its earlier name "flash"): the blockwise core over all past
  key blocks (O(T) memory, O(T^2) time, future blocks skipped). `"reference"`:
  the dense `[T, T]` masked softmax (O(T^2) memory; the tests' reference).
  `"gpu"` (or "cudnn"): cuDNN's fused attention on a GPU; `"splash"`: the TPU kernel.
  """
  if backends.canonical(impl) == "reference":
    return reference_causal_attention(q_BTHK, k_BTHK, v_BTHK, scale=scale)
  return _attend(q_BTHK, k_BTHK, v_BTHK, Pattern.dense(), scale=scale, impl=impl,
                 interpret=interpret)


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
    impl: str = "xla",
    interpret: bool = False,
) -> jax.Array:
  """Token i of block b = i // block_size attends to every j <= i with b - lookback <= j // block_size.

  lookback=0 is BCMT's local attention, lookback=1 ECP's pair of segments. Any
  T. Cost O(T * (lookback + 1) * block_size), memory O(T).
  """
  _check_positive("block_size", block_size)
  _check_lookback(lookback)
  return _attend(q_BTHK, k_BTHK, v_BTHK, Pattern.blocks(block_size, lookback), scale=scale,
                 impl=impl, interpret=interpret)


def sliding_window_attention(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    *,
    window: int,
    scale: float | None = None,
    impl: str = "xla",
    interpret: bool = False,
) -> jax.Array:
  """Token i attends to j with i - window < j <= i. Cost O(T * window), memory O(T)."""
  _check_positive("window", window)
  return _attend(q_BTHK, k_BTHK, v_BTHK, Pattern.sliding(window), scale=scale, impl=impl,
                 interpret=interpret)


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
    impl: str = "xla",
    interpret: bool = False,
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
    return _attend(q_BTHK, k_BTHK, v_BTHK, pattern, scale=scale, impl=impl, interpret=interpret)
  return _attend(q_BTHK, k_BTHK, v_BTHK, pattern, scale=scale, impl=impl, interpret=interpret,
                 local_prior=local_BTH, skip_prior=skip_BTH)
