"""Grouped-query attention in the core: q with H heads, k and v with H_kv heads dividing H.

Query head h reads key/value head h // G (G = H / H_kv query heads per group: consecutive query
heads share one, as `jnp.repeat(k, G, axis=heads)` would give them), and nothing ever repeats k
or v in memory: the query side's heads axis is viewed as `[H_kv, G]` (a free reshape of
consecutive heads) and each contraction runs per key/value head, batched over it. With G = 1
(H_kv = H) every function here is exactly the einsum or product it replaces.

    einsum     the core's heads-first einsums (heads on axis 1): QK^T, PV, and their gradients
    rows_dot   q.k of two position-aligned arrays, per row (π's shifted skip keys)
    scaled     rows[..., None] x a key-side array: p v, ds k (query-side result)
    group_sum  a query-side array summed over each group: a key-side gradient (dk, dv)
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops import precision


def groups(q_heads: int, kv_heads: int) -> int:
  """G = q_heads / kv_heads query heads per key/value head (ValueError unless kv_heads divides)."""
  if kv_heads < 1 or q_heads % kv_heads:
    raise ValueError(f"k and v have {kv_heads} heads, q {q_heads}: grouped-query attention needs "
                     "the key/value heads to divide the query heads (model.num_kv_heads a "
                     "divisor of model.num_heads)")
  return q_heads // kv_heads


def split(x: jax.Array, axis: int, kv_heads: int) -> jax.Array:
  """x's heads axis `axis` (H) as `[H_kv, G]` (a free reshape)."""
  return x.reshape(*x.shape[:axis], kv_heads, x.shape[axis] // kv_heads, *x.shape[axis + 1:])


def merge(x: jax.Array, axis: int) -> jax.Array:
  """The inverse of `split`: axes `axis`, `axis + 1` ([H_kv, G]) as one heads axis."""
  return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])


def einsum(spec: str, a: jax.Array, b: jax.Array, kv_heads: int) -> jax.Array:
  """`precision.einsum_f32(spec, a, b)` of heads-first operands ('h' their axis 1), an operand
  with more than `kv_heads` heads on the query side: its heads split `[H_kv, G]`. One query-side
  operand gives a query-side result (QK^T, PV, dP, dQ); two give a key-side one, summed over the
  group inside the contraction (dK, dV)."""
  g_a, g_b = a.shape[1] // kv_heads, b.shape[1] // kv_heads
  if g_a == 1 and g_b == 1:
    return precision.einsum_f32(spec, a, b)
  inputs, out = spec.split("->")
  spec_a, spec_b = inputs.split(",")
  with_group = lambda s: s[:2] + "z" + s[2:]  # 'z': the group's member
  if g_a > 1:
    a, spec_a = split(a, 1, kv_heads), with_group(spec_a)
  if g_b > 1:
    b, spec_b = split(b, 1, kv_heads), with_group(spec_b)
  query_side = (g_a > 1) != (g_b > 1)
  result = precision.einsum_f32(f"{spec_a},{spec_b}->{with_group(out) if query_side else out}",
                                a, b)
  return merge(result, 1) if query_side else result


def rows_dot(q: jax.Array, k: jax.Array, axis: int) -> jax.Array:
  """`[..., H]`-row dot products sum_k q * k of two position-aligned arrays (`[B, T, H, K]` or
  `[B, H, T, K]`, heads on `axis`), float32; k may have fewer heads (its group's)."""
  if q.shape[axis] == k.shape[axis]:
    return precision.einsum_f32("bthk,bthk->bth", q, k)
  spec = "bthgk,bthk->bthg" if axis == 2 else "bhgtk,bhtk->bhgt"
  return merge(precision.einsum_f32(spec, split(q, axis, k.shape[axis]), k), axis)


def scaled(rows_1: jax.Array, x: jax.Array, axis: int) -> jax.Array:
  """rows_1 * x, float32: rows_1 query-side rows with a unit last axis (`[B, T, H, 1]` /
  `[B, H, T, 1]`), x with the query heads or fewer (its group's, broadcast over the group, never
  repeated)."""
  if rows_1.shape[axis] == x.shape[axis]:
    return rows_1 * x.astype(jnp.float32)
  kv_heads = x.shape[axis]
  out = split(rows_1, axis, kv_heads) * jnp.expand_dims(x.astype(jnp.float32), axis + 1)
  return merge(out, axis)


def group_sum(x: jax.Array, axis: int, kv_heads: int) -> jax.Array:
  """A query-side array summed over each group of `axis`: `kv_heads` heads (x when equal)."""
  if x.shape[axis] == kv_heads:
    return x
  return jnp.sum(split(x, axis, kv_heads), axis=axis + 1)
