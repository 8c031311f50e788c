"""Attention ops on `[B, T, H, K]` arrays (the layout of `jax.nn.dot_product_attention`).

`causal_attention` is the dense O(T^2) reference; the efficient ops of later
modules are tested against plain masked references built like it.
"""

import jax
import jax.numpy as jnp


def _default_scale(q_BTHK: jax.Array, scale: float | None) -> float:
  return q_BTHK.shape[-1] ** -0.5 if scale is None else scale


def causal_attention(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    *,
    scale: float | None = None,
) -> jax.Array:
  """Dense causal softmax attention: token i attends to every j <= i.

  Builds the `[T, T]` score matrix: O(T^2) time and memory. This is the dense
  baseline and the reference the efficient ops are compared with. Scores and
  softmax are computed in float32 whatever the input dtype.
  """
  T = q_BTHK.shape[1]
  scale = _default_scale(q_BTHK, scale)
  scores_BHTT = jnp.einsum("bqhk,bthk->bhqt", q_BTHK, k_BTHK,
                           preferred_element_type=jnp.float32) * scale
  causal_TT = jnp.tril(jnp.ones((T, T), dtype=bool))
  scores_BHTT = jnp.where(causal_TT, scores_BHTT, -jnp.inf)
  probs_BHTT = jax.nn.softmax(scores_BHTT, axis=-1)
  return jnp.einsum("bhqt,bthk->bqhk", probs_BHTT.astype(v_BTHK.dtype), v_BTHK)
