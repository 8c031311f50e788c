"""The dense reference op against jax.nn.dot_product_attention, forward and gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


from efficient_lm.ops import attention


def _qkv(B, T, H, K, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(k, (B, T, H, K), jnp.float32) for k in keys]


@pytest.mark.slow
@pytest.mark.parametrize("B,T,H,K", [(2, 17, 3, 16), (1, 1, 1, 8), (1, 64, 4, 32)])
def test_causal_attention_matches_jax(B, T, H, K):
  q, k, v = _qkv(B, T, H, K)
  got = attention.causal_attention(q, k, v)
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

  def loss(fn):
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))

  grads = jax.grad(loss(attention.causal_attention), argnums=(0, 1, 2))(q, k, v)
  want_grads = jax.grad(loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
                        argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def test_causal_attention_scale_and_future_independence():
  q, k, v = _qkv(1, 12, 2, 8, seed=1)
  got = attention.causal_attention(q, k, v, scale=0.3)
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=0.3)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  # Changing keys/values from position 6 on leaves outputs 0..5 unchanged.
  k2 = k.at[:, 6:].add(1.0)
  v2 = v.at[:, 6:].add(1.0)
  changed = attention.causal_attention(q, k2, v2, scale=0.3)
  np.testing.assert_array_equal(changed[:, :6], got[:, :6])
  assert not np.allclose(changed[:, 6:], got[:, 6:])
