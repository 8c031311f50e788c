"""Array helpers the XLA core's modules share: windows, slices and adds along one axis.

Each takes a static (Python int) or a traced start: `window` is zero (or a
given value) where it reaches outside the array, `slice_at` and `add_at` stay
inside it; `vma_zero` types the loops' carries inside `shard_map`.
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops.core.plan import is_static

F32 = jnp.float32


def pad_axis(x: jax.Array, axis: int, before: int, after: int, value=0) -> jax.Array:
  pad = [(0, 0)] * x.ndim
  pad[axis] = (before, after)
  return jnp.pad(x, pad, constant_values=value)


def window(x: jax.Array, start, size: int, axis: int = 2, value=0) -> jax.Array:
  """x[start:start + size] along `axis`, `value` where that is outside x."""
  n = x.shape[axis]
  if is_static(start):
    lo, hi = max(start, 0), min(start + size, n)
    if lo >= hi:
      shape = list(x.shape)
      shape[axis] = size
      return jnp.full(shape, value, x.dtype)
    piece = jax.lax.slice_in_dim(x, lo, hi, axis=axis)
    return pad_axis(piece, axis, lo - start, start + size - hi, value)
  if size > n:  # x is the smaller: padded by `size` on both sides, any overlapping window fits
    padded = pad_axis(x, axis, size, size, value)
    return jax.lax.dynamic_slice_in_dim(padded, start + size, size, axis=axis)
  # Only the window is copied, never all of x: the in-range slice nearest `start`, then shifted
  # (non-zero shift only at x's ends) with `value` filled in.
  inside = jnp.clip(start, 0, n - size)
  piece = pad_axis(jax.lax.dynamic_slice_in_dim(x, inside, size, axis=axis), axis, size, size, value)
  return jax.lax.dynamic_slice_in_dim(piece, start - inside + size, size, axis=axis)


def window_transpose(y: jax.Array, start, n: int, axis: int = 2) -> jax.Array:
  """The adjoint of `window(x, start, y.shape[axis])` for an x of length n: y placed back at
  `start` (the zero-extended shift the other way)."""
  return window(y, -start, n, axis)


def slice_at(x: jax.Array, start, size: int, axis: int) -> jax.Array:
  """x[start:start + size] along `axis`, inside x."""
  if is_static(start):
    return jax.lax.slice_in_dim(x, start, start + size, axis=axis)
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def add_at(buf: jax.Array, start, update: jax.Array, axis: int = 2) -> jax.Array:
  """buf with `update` added at [start:start + len] along `axis` (in place under a loop)."""
  size = update.shape[axis]
  current = slice_at(buf, start, size, axis)
  return jax.lax.dynamic_update_slice_in_dim(buf, current + update, start, axis=axis)


def vma_zero(*xs) -> jax.Array:
  """A float32 scalar 0 varying over every mesh axis any of xs varies over: loop carries
  initialized from it match their bodies' types inside `shard_map`."""
  zero = jnp.zeros((), F32)
  for x in xs:
    if x is not None and not is_static(x):
      zero = zero + jnp.zeros_like(x, shape=(), dtype=F32)
  return zero
