"""exponential_memory (lax.scan) and its associative_scan form against a direct double sum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from efficient_lm.ops import memory


def direct_sum(s_BND, alpha):
  """m[:, i] = sum_{j<=i} alpha^(i-j) s[:, j] / sum_{j<=i} alpha^(i-j), in float64."""
  s = np.asarray(s_BND, np.float64)
  m = np.zeros_like(s)
  for i in range(s.shape[1]):
    w_J = alpha ** (i - np.arange(i + 1, dtype=np.float64))
    m[:, i] = np.einsum("j,bjd->bd", w_J, s[:, :i + 1]) / w_J.sum()
  return m


OPS = {"scan": jax.jit(memory.exponential_memory, static_argnums=1),
       "parallel": jax.jit(memory.exponential_memory_parallel, static_argnums=1)}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("N,alpha", [(1, 0.8), (7, 0.8), (13, 0.3), (16, 0.999)])
def test_equals_direct_sum(op, N, alpha):
  s_BND = jax.random.normal(jax.random.key(N), (2, N, 5), jnp.float32)
  m_BND = OPS[op](s_BND, alpha)
  assert m_BND.shape == s_BND.shape and m_BND.dtype == s_BND.dtype
  np.testing.assert_allclose(m_BND, direct_sum(s_BND, alpha), atol=2e-6, rtol=2e-5)


def test_one_block_is_the_identity():
  s_BND = jax.random.normal(jax.random.key(0), (3, 1, 4))
  for op in OPS.values():
    np.testing.assert_allclose(op(s_BND, 0.8), s_BND, rtol=1e-6)


def test_gradients_agree():
  s_BND = jax.random.normal(jax.random.key(1), (2, 11, 4), jnp.float32)
  cot_BND = jax.random.normal(jax.random.key(2), s_BND.shape, jnp.float32)
  grads = {name: jax.jit(jax.grad(lambda s, op=op: jnp.sum(op(s, 0.8) * cot_BND)))(s_BND)
           for name, op in OPS.items()}
  # The op is linear in s: its gradient is the transposed map applied to the cotangent.
  weights_NJ = np.tril(0.8 ** np.maximum(np.arange(11)[:, None] - np.arange(11)[None, :], 0))
  weights_NJ /= weights_NJ.sum(axis=1, keepdims=True)
  expected = np.einsum("ij,bid->bjd", weights_NJ, np.asarray(cot_BND, np.float64))
  for g in grads.values():
    np.testing.assert_allclose(g, expected, atol=1e-6, rtol=1e-5)


def test_causal():
  s_BND = jax.random.normal(jax.random.key(3), (2, 7, 5))
  changed = s_BND.at[:, 5].add(10.0)
  for op in OPS.values():
    np.testing.assert_array_equal(op(s_BND, 0.8)[:, :5], op(changed, 0.8)[:, :5])
    assert not np.allclose(op(s_BND, 0.8)[:, 5:], op(changed, 0.8)[:, 5:])


def test_bfloat16_accumulates_in_float32():
  s_BND = jax.random.normal(jax.random.key(4), (1, 16, 4)).astype(jnp.bfloat16)
  for op in OPS.values():
    m_BND = op(s_BND, 0.99)
    assert m_BND.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(m_BND, np.float32), direct_sum(s_BND.astype(jnp.float32), 0.99),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 1.5])
def test_alpha_outside_open_interval_is_refused(alpha):
  with pytest.raises(ValueError, match="alpha"):
    memory.exponential_memory(jnp.zeros((1, 2, 3)), alpha)
