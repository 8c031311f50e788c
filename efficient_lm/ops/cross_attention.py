"""The two attentions of the Perceiver-AR family, on `[B, T, H, K]` arrays, on the core.

- `causal_cross_attention`: Z latent queries, the last of a stream of T keys,
  each seeing the keys up to its own position. Cost O(Z * T) time, O(Z + T)
  memory (the core's blocks), never a `[T, T]` array.
- `segment_attention`: bidirectional attention inside disjoint equal segments
  (the refined history of the double-attention models: no history position is
  predicted, so it may look both ways). Cost O(T^2 / num_segments).

Both run on the backend `impl` (`ops.core.backends`), like every attention op.
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops import core
from efficient_lm.ops.pattern import Pattern


def causal_cross_attention(
    q_BZHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    *,
    query_offset: int,
    scale: float | None = None,
    impl: str = "xla",
    interpret: bool = False,
) -> jax.Array:
  """Query z sits at stream position `query_offset + z` and attends to every key j <= it.

  `query_offset = T - Z` is Perceiver-AR's latent cross-attention (the keys
  are the history followed by the latents); `query_offset = 0` with Z = T is
  plain causal self-attention. Scores and softmax in float32.
  """
  Z, T = q_BZHK.shape[1], k_BTHK.shape[1]
  if not isinstance(query_offset, int) or not 0 <= query_offset <= T - Z:
    raise ValueError(f"query_offset={query_offset!r} must be an integer in [0, T - Z] = [0, {T - Z}]")
  return core.attend(q_BZHK, k_BTHK, v_BTHK, Pattern.dense(), q_start=query_offset,
                     scale=scale, impl=impl, interpret=interpret, with_lse=False)[0]


def segment_attention(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    *,
    num_segments: int = 1,
    scale: float | None = None,
    impl: str = "xla",
    interpret: bool = False,
) -> jax.Array:
  """Bidirectional (unmasked) attention inside each of `num_segments` equal, disjoint segments.

  num_segments=1 is full bidirectional attention. T must be a multiple of
  num_segments; T = 0 (no history) returns an empty array.
  """
  T = q_BTHK.shape[1]
  if not isinstance(num_segments, int) or num_segments < 1 or T % num_segments:
    raise ValueError(f"num_segments={num_segments!r} must be a positive divisor of T={T}")
  if T == 0:
    return jnp.zeros_like(q_BTHK)
  return core.attend(q_BTHK, k_BTHK, v_BTHK, Pattern.segments(T // num_segments), scale=scale,
                     impl=impl, interpret=interpret, with_lse=False)[0]
