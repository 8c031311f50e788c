"""Attentions over disjoint key sets merged into the attention over their union, by log-sum-exp."""

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32


def merge(parts: list[tuple[jax.Array, jax.Array]]) -> tuple[jax.Array, jax.Array]:
  """Attention over disjoint key sets -> attention over their union: o = sum_i exp(lse_i - lse) o_i.

  Each part is (o, lse) from `attend` (either layout: lse has o's shape minus
  the last axis). Rows no part sees keep o = 0 and lse = `NO_KEY_LSE`.
  """
  if not parts:
    raise ValueError("merge needs at least one (o, lse) part")
  if len(parts) == 1:
    return parts[0]
  lses = [lse.astype(F32) for _, lse in parts]
  peak = jax.lax.stop_gradient(functools.reduce(jnp.maximum, lses))
  total = functools.reduce(jnp.add, [jnp.exp(lse - peak) for lse in lses])
  lse = peak + jnp.log(total)
  o = functools.reduce(jnp.add, [jnp.exp(l - lse)[..., None] * o.astype(F32)
                                 for (o, _), l in zip(parts, lses)])
  return o.astype(parts[0][0].dtype), lse
