"""Exponential causal memory over block summaries (BCMT; docs/architecture.md, "BCMT and HOnly").

    m[:, i] = sum_{j<=i} alpha^(i-j) s[:, j] / sum_{j<=i} alpha^(i-j)

Normalized and inclusive. `exponential_memory` runs the recurrence
`num = alpha * num + s; den = alpha * den + 1` with `jax.lax.scan` over the N
blocks; `exponential_memory_parallel` computes the same affine recurrence with
`jax.lax.associative_scan` (O(N log N) work, depth O(log N), no `[N, N]` decay
matrix). Both accumulate in float32 and return the input dtype.
"""

import jax
import jax.numpy as jnp


def _check_alpha(alpha) -> None:
  if isinstance(alpha, (int, float)) and not 0.0 < alpha < 1.0:
    raise ValueError(f"alpha={alpha!r} must be in (0, 1)")


def exponential_memory(s_BND: jax.Array, alpha: float | jax.Array) -> jax.Array:
  """Normalized inclusive exponential memory, sequential over blocks (`lax.scan`)."""
  _check_alpha(alpha)
  B, N, D = s_BND.shape
  alpha = jnp.asarray(alpha, jnp.float32)

  def update(carry, s_BD):
    num_BD, den = carry
    num_BD = alpha * num_BD + s_BD.astype(jnp.float32)
    den = alpha * den + 1.0
    return (num_BD, den), num_BD / den

  init = (jnp.zeros_like(s_BND[:, 0], jnp.float32), jnp.zeros((), jnp.float32))  # shard_map-safe
  _, m_NBD = jax.lax.scan(update, init, jnp.swapaxes(s_BND, 0, 1))
  return jnp.swapaxes(m_NBD, 0, 1).astype(s_BND.dtype)


def exponential_memory_parallel(s_BND: jax.Array, alpha: float | jax.Array) -> jax.Array:
  """The same memory with `jax.lax.associative_scan` over the blocks.

  Each block is the affine map x -> alpha * x + s; composing (a1, b1) then
  (a2, b2) gives (a1 * a2, a2 * b1 + b2). The denominator is the same scan with
  s = 1.
  """
  _check_alpha(alpha)
  B, N, D = s_BND.shape
  alpha = jnp.asarray(alpha, jnp.float32)

  def compose(first, second):
    a1, num1, den1 = first
    a2, num2, den2 = second
    return a1 * a2, a2[:, None, None] * num1 + num2, a2 * den1 + den2

  decay_N = jnp.full((N,), alpha)
  _, num_NBD, den_N = jax.lax.associative_scan(
      compose, (decay_N, jnp.swapaxes(s_BND, 0, 1).astype(jnp.float32), jnp.ones((N,), jnp.float32)))
  m_NBD = num_NBD / den_N[:, None, None]
  return jnp.swapaxes(m_NBD, 0, 1).astype(s_BND.dtype)
