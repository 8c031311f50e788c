"""block_local, sliding window and π attention against plain dense masked references.

The references build the full `[T, T]` mask from the ops' definitions (docs/architecture.md), one
position pair at a time; the ops must agree forward and in every gradient.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first

from efficient_lm.ops import attention


def qkv(T, B=2, H=2, K=8, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(k, (B, T, H, K), jnp.float32) for k in keys]


def dense_reference(q, k, v, allowed_TT, bias_BTHT=None):
  """softmax over allowed j of q_i . k_j / sqrt(K) (+ bias), as dense as it gets."""
  logits = jnp.einsum("bihk,bjhk->bhij", q, k) / np.sqrt(q.shape[-1])
  if bias_BTHT is not None:
    logits = logits + jnp.transpose(bias_BTHT, (0, 2, 1, 3))
  logits = jnp.where(jnp.asarray(allowed_TT)[None, None], logits, -jnp.inf)
  return jnp.einsum("bhij,bjhk->bihk", jax.nn.softmax(logits, axis=-1), v)


def block_local_mask(T, block_size, lookback):
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  return (j <= i) & (j // block_size >= i // block_size - lookback)


def window_mask(T, window):
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  return (j <= i) & (j > i - window)


def skip_mask(T, window, period, num_skips):
  m = np.zeros((T, T), bool)
  for i in range(T):
    for s in range(1, num_skips + 1):
      j = i - s * period
      if j >= 0 and j <= i - window:
        m[i, j] = True
  return m


def pi_reference(q, k, v, gate, window, period, num_skips):
  T = q.shape[1]
  local, skip = window_mask(T, window), skip_mask(T, window, period, num_skips)
  g = jnp.clip(gate, 1e-6, 1 - 1e-6)[..., None]  # [B, T, H, 1]
  as_bias = lambda m: jnp.asarray(m)[None, :, None, :]  # [1, T_i, 1, T_j]
  bias = jnp.where(as_bias(local), jnp.log(g), jnp.where(as_bias(skip), jnp.log1p(-g), 0.0))
  return dense_reference(q, k, v, local | skip, bias)


def assert_same_function(fast, reference, args, atol=2e-5):
  """Same values, and same gradients of a non-linear readout, for every argument."""
  np.testing.assert_allclose(jax.jit(fast)(*args), jax.jit(reference)(*args), atol=atol, rtol=atol)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(3.0 * f(*a)))
  argnums = tuple(range(len(args)))
  grad = lambda f: jax.jit(jax.grad(loss(f), argnums))(*args)
  for got, want in zip(grad(fast), grad(reference)):
    np.testing.assert_allclose(got, want, atol=10 * atol, rtol=10 * atol)


@pytest.mark.parametrize("T,block_size,lookback", fast_first([
    (16, 4, 0), (16, 4, 1), (16, 4, 2), (37, 8, 0), (37, 8, 1), (37, 5, 2),  # ragged T
    (5, 64, 0), (5, 64, 1),  # T smaller than one block
    (13, 1, 0), (13, 1, 3), (24, 24, 1),
], keep=(3, 5, 7)))
def test_block_local_attention(T, block_size, lookback):
  allowed = block_local_mask(T, block_size, lookback)
  assert_same_function(
      lambda q, k, v: attention.block_local_attention(q, k, v, block_size=block_size, lookback=lookback),
      lambda q, k, v: dense_reference(q, k, v, allowed), qkv(T))


@pytest.mark.parametrize("T,window", fast_first([(1, 1), (9, 1), (33, 4), (33, 8), (33, 32), (33, 33),
                                                (20, 100)], keep=(2, 6)))
def test_sliding_window_attention(T, window):
  allowed = window_mask(T, window)
  assert_same_function(
      lambda q, k, v: attention.sliding_window_attention(q, k, v, window=window),
      lambda q, k, v: dense_reference(q, k, v, allowed), qkv(T))


PI_CASES = [
    # (T, window, period, num_skips): windows and periods below, at and above T; periods below the window.
    (40, 8, 8, 3), (40, 8, 5, 4), (40, 3, 7, 5), (40, 1, 1, 6), (40, 16, 4, 6),
    (37, 8, 12, 2), (24, 50, 4, 2), (24, 4, 64, 3), (24, 4, 24, 1), (24, 6, 6, 0),
]


@pytest.mark.parametrize("T,window,period,num_skips", fast_first(PI_CASES, keep=(0, 5, 7)))
def test_pi_attention(T, window, period, num_skips):
  q, k, v = qkv(T, seed=T + window)
  gate = jax.nn.sigmoid(jax.random.normal(jax.random.key(7), (2, T, 2)))
  assert_same_function(
      lambda q, k, v, g: attention.pi_attention(q, k, v, g, window=window, period=period,
                                                num_skips=num_skips),
      lambda q, k, v, g: pi_reference(q, k, v, g, window, period, num_skips), (q, k, v, gate))


@pytest.mark.parametrize("gate_logit", fast_first([-40.0, 40.0, -10.0, 10.0], keep=(1,)))
def test_pi_attention_gate_near_0_and_1(gate_logit):
  """float32 sigmoid gives exactly 0 or 1 at +-40: values and gradients stay finite and match."""
  T, window, period, num_skips = 32, 4, 6, 3
  q, k, v = qkv(T, seed=3)
  logits = jnp.full((2, T, 2), gate_logit)

  def fast(q, k, v, z):
    return attention.pi_attention(q, k, v, jax.nn.sigmoid(z), window=window, period=period,
                                  num_skips=num_skips)

  def reference(q, k, v, z):
    return pi_reference(q, k, v, jax.nn.sigmoid(z), window, period, num_skips)

  out = fast(q, k, v, logits)
  assert np.all(np.isfinite(out))
  grads = jax.grad(lambda *a: jnp.sum(fast(*a)), argnums=(0, 1, 2, 3))(q, k, v, logits)
  assert all(np.all(np.isfinite(g)) for g in grads)
  assert_same_function(fast, reference, (q, k, v, logits), atol=1e-4)


def test_pi_gate_changes_the_output():
  T = 32
  q, k, v = qkv(T, seed=5)
  run = lambda g: attention.pi_attention(q, k, v, jnp.full((2, T, 2), g), window=4, period=4,
                                         num_skips=4)
  local_only = attention.sliding_window_attention(q, k, v, window=4)
  assert not np.allclose(run(0.2), run(0.8), atol=1e-3)
  # As the gate goes to 1 the skips' prior weight vanishes: the output becomes the window's.
  np.testing.assert_allclose(run(1.0), local_only, atol=1e-4)
  # Before the first skip lands (i < period) every gate gives the window's output.
  np.testing.assert_allclose(run(0.2)[:, :4], local_only[:, :4], atol=1e-5)


def test_bad_arguments_raise():
  q, k, v = qkv(8)
  gate = jnp.full((2, 8, 2), 0.5)
  for call in (lambda: attention.block_local_attention(q, k, v, block_size=0),
               lambda: attention.block_local_attention(q, k, v, block_size=4, lookback=-1),
               lambda: attention.sliding_window_attention(q, k, v, window=0),
               lambda: attention.pi_attention(q, k, v, gate, window=4, period=0, num_skips=1),
               lambda: attention.pi_attention(q, k, v, gate, window=4, period=2, num_skips=-1)):
    with pytest.raises(ValueError, match="must be"):
      call()
