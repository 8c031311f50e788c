"""A block's sequence in chunks: what lets one device train at a million tokens of context.

With `model.seq_chunk = C`, a decoder block runs over chunks of C tokens in a
`lax.map`, each chunk rematerialized in the backward pass: the norm, the
keys and values, the queries, the attention of the chunk's queries over the
keys they can see, the output projection, the gate, the residual adds and the
MLP. The chunk's queries see a *window*: its own C keys after the `halo` keys
before it (the attention pattern's reach: the window, the previous blocks, the
farthest π skip); the chunk computes those keys and values itself, from the
block inputs of the halo positions, which are cut for every chunk by static
slices of the chunks before it (`halos`: the only sequence-wide copy, `halo`
tokens a chunk, no gather). So nothing of a block outlives its chunk but the
block's input and output: a block's temporaries are a few `[B, T, D]` arrays
(lane-dense on a TPU, which tiles the last two dimensions by (8, 128)) plus
one chunk's work, whatever T. The halo's keys are computed once more by the
chunk after (halo / C extra projections). A pattern with unbounded reach
(dense attention) cannot be chunked this way.
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops import blockwise
from efficient_lm.ops import ring
from efficient_lm.ops.pattern import Pattern


def halo(patterns: Pattern | tuple[Pattern, ...], chunk: int) -> int:
  """Keys before a chunk (of `chunk` queries, starting at a multiple of it) the queries of any of
  `patterns` may see (`ops.ring.halo`, the ring's halo too); 0 for a mixer without attention (a
  recurrence carries its state from chunk to chunk instead: `decoder.ChunkContext`)."""
  patterns = (patterns,) if isinstance(patterns, Pattern) else tuple(patterns)
  return max((ring.halo(pattern, chunk) for pattern in patterns), default=0)


def split(x_BT: jax.Array, chunk: int) -> jax.Array:
  """`[B, T, ...]` -> `[n, B, C, ...]` (T a multiple of C): `blockwise.split_blocks`, chunks first."""
  return jnp.moveaxis(blockwise.split_blocks(x_BT, chunk), 1, 0)


def merge(x_nBC: jax.Array) -> jax.Array:
  """`[n, B, C, ...]` -> `[B, n * C, ...]` (the inverse of `split`)."""
  n, _, C = x_nBC.shape[:3]
  return blockwise.merge_blocks(jnp.moveaxis(x_nBC, 0, 1), n * C)


def halos(chunks_nBC: jax.Array, halo_len: int) -> jax.Array:
  """`[n, B, halo, ...]`: the `halo` positions before each chunk, from the chunks before it (zeros
  before the sequence start, which the attention masks by position). Static slices only."""
  n, chunk = chunks_nBC.shape[:3:2]
  if halo_len == 0:
    return chunks_nBC[:, :, :0]
  back = -(-halo_len // chunk)  # chunks a halo reaches back into
  shifted = lambda s: jnp.pad(chunks_nBC, [(s, 0)] + [(0, 0)] * (chunks_nBC.ndim - 1))[:n]
  pieces = [shifted(s) for s in range(back, 0, -1)]
  return jnp.concatenate(pieces, axis=2)[:, :, back * chunk - halo_len:]


def window(halo_BHD: jax.Array, chunk_BCD: jax.Array) -> jax.Array:
  """A chunk's inputs after its halo's: `[B, halo + C, ...]` (one chunk's copy, inside the map)."""
  return chunk_BCD if halo_BHD is None or halo_BHD.shape[1] == 0 else jnp.concatenate([halo_BHD, chunk_BCD], axis=1)


def map_chunks(fn, *xs_n):
  """`lax.map` of `fn(*chunk_inputs)` over the leading axis, each chunk rematerialized."""
  return jax.lax.map(lambda args: jax.checkpoint(fn)(*args), xs_n)
