"""The two attentions of the Perceiver-AR family, on `[B, T, H, K]` arrays.

- `causal_cross_attention`: Z latent queries, the last of a stream of T keys,
  each seeing the keys up to its own position. Cost O(Z * T): the `[Z, T]`
  score block, never `[T, T]` (unless Z = T, when it is plain causal attention).
- `segment_attention`: bidirectional attention inside disjoint equal segments
  (the refined history of the double-attention models: no history position is
  predicted, so it may look both ways). Cost O(T^2 / num_segments).
"""

import jax
import jax.numpy as jnp


def causal_cross_attention(
    q_BZHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    *,
    query_offset: int,
    scale: float | None = None,
) -> jax.Array:
  """Query z sits at stream position `query_offset + z` and attends to every key j <= it.

  `query_offset = T - Z` is Perceiver-AR's latent cross-attention (the keys
  are the history followed by the latents); `query_offset = 0` with Z = T is
  plain causal self-attention. Scores and softmax in float32.
  """
  Z, T = q_BZHK.shape[1], k_BTHK.shape[1]
  if not isinstance(query_offset, int) or not 0 <= query_offset <= T - Z:
    raise ValueError(f"query_offset={query_offset!r} must be an integer in [0, T - Z] = [0, {T - Z}]")
  scale = q_BZHK.shape[-1] ** -0.5 if scale is None else scale
  logits_BHZT = jnp.einsum("bzhk,bthk->bhzt", q_BZHK, k_BTHK,
                           preferred_element_type=jnp.float32) * scale
  visible_ZT = jnp.arange(T)[None, :] <= query_offset + jnp.arange(Z)[:, None]
  logits_BHZT = jnp.where(visible_ZT, logits_BHZT, -jnp.inf)
  probs_BHZT = jax.nn.softmax(logits_BHZT, axis=-1)
  return jnp.einsum("bhzt,bthk->bzhk", probs_BHZT.astype(v_BTHK.dtype), v_BTHK)


def segment_attention(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    *,
    num_segments: int = 1,
    scale: float | None = None,
) -> jax.Array:
  """Bidirectional (unmasked) attention inside each of `num_segments` equal, disjoint segments.

  num_segments=1 is full bidirectional attention. T must be a multiple of
  num_segments; T = 0 (no history) returns an empty array.
  """
  B, T, H, K = q_BTHK.shape
  if not isinstance(num_segments, int) or num_segments < 1 or T % num_segments:
    raise ValueError(f"num_segments={num_segments!r} must be a positive divisor of T={T}")
  if T == 0:
    return jnp.zeros_like(q_BTHK)
  scale = K ** -0.5 if scale is None else scale
  split = lambda x: x.reshape(B, num_segments, T // num_segments, H, K)
  logits_BSHLM = jnp.einsum("bslhk,bsmhk->bshlm", split(q_BTHK), split(k_BTHK),
                            preferred_element_type=jnp.float32) * scale
  probs_BSHLM = jax.nn.softmax(logits_BSHLM, axis=-1)
  o_BSLHK = jnp.einsum("bshlm,bsmhk->bslhk", probs_BSHLM.astype(v_BTHK.dtype), split(v_BTHK))
  return o_BSLHK.reshape(B, T, H, K)
