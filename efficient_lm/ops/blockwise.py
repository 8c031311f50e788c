"""Cutting a sequence into blocks and back (BCMT's per-block pooling and memory).

The attention itself, block-local included, is `ops.core.attend`.
"""

import jax
import jax.numpy as jnp


def split_blocks(x_BT: jax.Array, block_size: int) -> jax.Array:
  """`[B, T, ...]` -> `[B, N, L, ...]`, zero-padding T up to a multiple of L."""
  B, T = x_BT.shape[:2]
  N = -(-T // block_size)
  pad = [(0, 0), (0, N * block_size - T)] + [(0, 0)] * (x_BT.ndim - 2)
  return jnp.pad(x_BT, pad).reshape(B, N, block_size, *x_BT.shape[2:])


def merge_blocks(x_BNL: jax.Array, T: int) -> jax.Array:
  """`[B, N, L, ...]` -> `[B, T, ...]`, dropping the padding."""
  B, N, L = x_BNL.shape[:3]
  return x_BNL.reshape(B, N * L, *x_BNL.shape[3:])[:, :T]
