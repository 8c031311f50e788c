"""Exponential causal memory over block summaries (BCMT; docs/architecture.md, "BCMT and HOnly").

    m[:, i] = sum_{j<=i} alpha^(i-j) s[:, j] / sum_{j<=i} alpha^(i-j)

Normalized and inclusive. `exponential_memory` runs the recurrence
`num = alpha * num + s; den = alpha * den + 1` with `jax.lax.scan` over the N
blocks; `exponential_memory_parallel` computes the same affine recurrence with
`jax.lax.associative_scan` (O(N log N) work, depth O(log N), no `[N, N]` decay
matrix). Both accumulate in float32 and return the input dtype. With
`keep_BN` (documents: 0 where a block starts a new document) the state before
block i is multiplied by keep[:, i]: the memory restarts there.
"""

import jax
import jax.numpy as jnp


def _check_alpha(alpha) -> None:
  if isinstance(alpha, (int, float)) and not 0.0 < alpha < 1.0:
    raise ValueError(f"alpha={alpha!r} must be in (0, 1)")


def _decay(s_BND: jax.Array, alpha, keep_BN: jax.Array | None) -> jax.Array:
  """`[B, N]` float32: what the state before each block is multiplied by (alpha, or 0 at a
  restart)."""
  alpha = jnp.asarray(alpha, jnp.float32)
  decay_BN = jnp.broadcast_to(alpha, s_BND.shape[:2])
  return decay_BN if keep_BN is None else decay_BN * keep_BN.astype(jnp.float32)


def memory_sums(s_BND: jax.Array, alpha: float | jax.Array, keep_BN: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
  """(num `[B, N, D]`, den `[B, N]`), float32: the recurrence's running sums from a zero state
  (`lax.scan` over the blocks); the memory is num / den."""
  _check_alpha(alpha)
  decay_NB = jnp.swapaxes(_decay(s_BND, alpha, keep_BN), 0, 1)

  def update(carry, inputs):
    num_BD, den_B = carry
    s_BD, decay_B = inputs
    num_BD = decay_B[:, None] * num_BD + s_BD.astype(jnp.float32)
    den_B = decay_B * den_B + 1.0
    return (num_BD, den_B), (num_BD, den_B)

  init = (jnp.zeros_like(s_BND[:, 0], jnp.float32), jnp.zeros_like(s_BND[:, 0, 0], jnp.float32))
  _, (num_NBD, den_NB) = jax.lax.scan(update, init, (jnp.swapaxes(s_BND, 0, 1), decay_NB))
  return jnp.swapaxes(num_NBD, 0, 1), jnp.swapaxes(den_NB, 0, 1)


def exponential_memory(s_BND: jax.Array, alpha: float | jax.Array,
                       keep_BN: jax.Array | None = None) -> jax.Array:
  """Normalized inclusive exponential memory, sequential over blocks (`lax.scan`)."""
  num_BND, den_BN = memory_sums(s_BND, alpha, keep_BN)
  return (num_BND / den_BN[..., None]).astype(s_BND.dtype)


def exponential_memory_parallel(s_BND: jax.Array, alpha: float | jax.Array,
                                keep_BN: jax.Array | None = None) -> jax.Array:
  """The same memory with `jax.lax.associative_scan` over the blocks.

  Each block is the affine map x -> a * x + s (a = alpha, or 0 at a restart); composing
  (a1, b1) then (a2, b2) gives (a1 * a2, a2 * b1 + b2). The denominator is the same scan with
  s = 1.
  """
  _check_alpha(alpha)

  def compose(first, second):
    a1, num1, den1 = first
    a2, num2, den2 = second
    return a1 * a2, a2[..., None] * num1 + num2, a2 * den1 + den2

  decay_NB = jnp.swapaxes(_decay(s_BND, alpha, keep_BN), 0, 1)
  _, num_NBD, den_NB = jax.lax.associative_scan(
      compose, (decay_NB, jnp.swapaxes(s_BND, 0, 1).astype(jnp.float32), jnp.ones_like(decay_NB)))
  m_NBD = num_NBD / den_NB[..., None]
  return jnp.swapaxes(m_NBD, 0, 1).astype(s_BND.dtype)
