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


def bf16_accumulating_memory(s_BND, alpha):
  """The same recurrence with a bfloat16 carry: what the float32 accumulation exists to avoid."""
  def update(carry, s_BD):
    num_BD, den = carry
    num_BD = (alpha * num_BD + s_BD).astype(jnp.bfloat16)
    den = (alpha * den + 1.0).astype(jnp.bfloat16)
    return (num_BD, den), (num_BD / den).astype(jnp.bfloat16)
  init = (jnp.zeros_like(s_BND[:, 0]), jnp.zeros((), jnp.bfloat16))
  return jnp.swapaxes(jax.lax.scan(update, init, jnp.swapaxes(s_BND, 0, 1))[1], 0, 1)


def test_bfloat16_inputs_accumulate_in_float32():
  """512 blocks at alpha 0.999: the sums reach ~400, where a bfloat16 carry drops most of each
  new summary (its ulp there is 2). The ops stay within the output's own rounding of the float64
  double sum; the bfloat16-accumulating recurrence misses by more than 1 (so this test can fail)."""
  N = 512
  s_BND = (jnp.linspace(0.0, 4.0, N)[None, :, None]
           + jax.random.normal(jax.random.key(4), (1, N, 4))).astype(jnp.bfloat16)
  expected = direct_sum(s_BND.astype(jnp.float32), 0.999)
  error = lambda m_BND: float(np.max(np.abs(np.asarray(m_BND, np.float32) - expected)))
  for op in OPS.values():
    m_BND = op(s_BND, 0.999)
    assert m_BND.dtype == jnp.bfloat16
    assert error(m_BND) < 0.02  # bfloat16 output rounding of values up to ~6: ulp/2 <= 0.016
  assert error(bf16_accumulating_memory(s_BND, 0.999)) > 1.0


@pytest.mark.parametrize("alpha", [0.0, 1.0, 1.5])
def test_alpha_outside_open_interval_is_refused(alpha):
  with pytest.raises(ValueError, match="alpha"):
    memory.exponential_memory(jnp.zeros((1, 2, 3)), alpha)
