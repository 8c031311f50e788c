"""The two attentions of the Perceiver-AR family, on `[B, T, H, K]` arrays: public functional ops.

- `causal_cross_attention`: Z latent queries, the last of a stream of T keys,
  each seeing the keys up to its own position. Cost O(Z * T) time, O(Z + T)
  memory (the core's blocks), never a `[T, T]` array.
- `segment_attention`: bidirectional attention inside disjoint equal segments
  (the refined history of the double-attention models: no history position is
  predicted, so it may look both ways). Cost O(T^2 / num_segments).

Both are a `Pattern` through `ops.route.attend` on the backend `impl`, like every attention.
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops import route as route_lib
from efficient_lm.ops.core import backends
from efficient_lm.ops.pattern import Pattern


def causal_cross_attention(q_BZHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *,
                           query_offset: int, scale: float | None = None, impl: str = "xla",
                           interpret: bool = False, segment_ids: jax.Array | None = None
                           ) -> jax.Array:
  """Query z sits at stream position `query_offset + z` and attends to every key j <= it.

  `query_offset = T - Z` is Perceiver-AR's latent cross-attention (the keys
  are the history followed by the latents); `query_offset = 0` with Z = T is
  plain causal self-attention. `segment_ids` `[B, T]`: the stream's document
  ids. Scores and softmax in float32.
  """
  Z, T = q_BZHK.shape[1], k_BTHK.shape[1]
  if not isinstance(query_offset, int) or not 0 <= query_offset <= T - Z:
    raise ValueError(f"query_offset={query_offset!r} must be an integer in [0, T - Z] = [0, {T - Z}]")
  route = route_lib.Route(impl=backends.canonical(impl), interpret=interpret)
  ids = {} if segment_ids is None else dict(
      segment_ids=segment_ids[:, query_offset:query_offset + Z], k_segment_ids=segment_ids)
  return route.attend(q_BZHK, k_BTHK, v_BTHK, Pattern.dense(), q_start=query_offset, scale=scale,
                      **ids)


def segment_attention(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *,
                      num_segments: int = 1, scale: float | None = None, impl: str = "xla",
                      interpret: bool = False, segment_ids: jax.Array | None = None) -> jax.Array:
  """Bidirectional (unmasked) attention inside each of `num_segments` equal, disjoint segments
  (and inside each document, with `segment_ids`).

  num_segments=1 is full bidirectional attention. T must be a multiple of
  num_segments; T = 0 (no history) returns an empty array.
  """
  T = q_BTHK.shape[1]
  if not isinstance(num_segments, int) or num_segments < 1 or T % num_segments:
    raise ValueError(f"num_segments={num_segments!r} must be a positive divisor of T={T}")
  if T == 0:
    return jnp.zeros_like(q_BTHK)
  route = route_lib.Route(impl=backends.canonical(impl), interpret=interpret)
  return route.attend(q_BTHK, k_BTHK, v_BTHK, Pattern.segments(T // num_segments), scale=scale,
                      segment_ids=segment_ids)
