"""The gated linear recurrence (`ops.recurrent.gated_linear_rule`, Gated DeltaNet's Mamba-2-style
ablation: S <- exp(g) S + k v^T, o = S^T (scale q)) against its plain per-token recurrence:
outputs, final state and every gradient, with documents at a ragged length; one decoding step;
over 4 devices (the ring) and on the Pallas kernel in interpret mode, equal to one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from efficient_lm.ops import recurrent
from test_recurrent import assert_close, documents, inputs, reference, values_and_grads


def case(B=2, T=45, H=2, K=8, V=6, seed=1):
  """q, k, v, g, the initial state and document ids that start inside a chunk, exactly at a chunk
  boundary (16) and one token long (30)."""
  q, k, v, g, _ = inputs(B, T, H, K, V, seed=seed)
  ids = np.array(documents(B, T, seed=seed))
  if T > 30:
    ids[0, 16:] += 5
    ids[0, 30] += 7
  initial = 0.5 * jax.random.normal(jax.random.key(seed), (B, H, K, V))
  return (q, k, v, g, initial), jnp.asarray(ids)


def assert_equal_functions(fast, slow, args, rtol=1e-5):
  B, _, H, K = args[0].shape
  keys = jax.random.split(jax.random.key(7), 2)
  cot_o = jax.random.normal(keys[0], args[2].shape)
  cot_s = jax.random.normal(keys[1], (B, H, K, args[2].shape[-1]))
  got, want = values_and_grads(fast, args, cot_o, cot_s), values_and_grads(slow, args, cot_o, cot_s)
  assert_close(got[0], want[0], rtol)
  assert_close(got[1], want[1], rtol)
  for name, g, w in zip("q k v g initial_state".split(), got[2], want[2]):
    assert np.all(np.isfinite(g)), name
    assert_close(g, w, rtol)


def op_and_reference(ids, **kw):
  fast = lambda q, k, v, g, s: recurrent.gated_linear_rule(q, k, v, g, segment_ids=ids,
                                                           initial_state=s, **kw)
  slow = lambda q, k, v, g, s: reference(q, k, v, g, segment_ids=ids, initial_state=s,
                                         scale=kw.get("scale"))
  return fast, slow


@pytest.mark.parametrize("chunk_size", [16, 7, 64])
def test_equals_recurrence_with_documents_at_a_ragged_length(chunk_size):
  args, ids = case()
  assert_equal_functions(*op_and_reference(ids, chunk_size=chunk_size, scale=0.7), args)


def test_is_not_the_delta_rule():
  """The ablation differs from the delta rule at beta = 1 (the test above could not tell them
  apart if the flag were lost): the delta rule's write subtracts what S recalls for k."""
  (q, k, v, g, initial), ids = case()
  linear, _ = recurrent.gated_linear_rule(q, k, v, g, segment_ids=ids, chunk_size=16)
  delta, _ = recurrent.gated_delta_rule(q, k, v, g, jnp.ones_like(g), segment_ids=ids,
                                        chunk_size=16)
  assert not np.allclose(linear, delta, atol=1e-3)


def test_decoding_steps_equal_the_chunked_form():
  (q, k, v, g, initial), _ = case(B=1, T=12)
  o, final = recurrent.gated_linear_rule(q, k, v, g, initial_state=initial, chunk_size=4)
  S = initial
  for t in range(12):
    o_t, S = recurrent.gated_linear_rule_step(S, q[:, t], k[:, t], v[:, t], g[:, t])
    assert_close(o_t, o[:, t])
  assert_close(S, final)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices")
def test_four_devices_equal_one():
  args, ids = case(T=48, seed=3)
  mesh = jax.make_mesh((4,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:4])
  fast, slow = op_and_reference(ids, chunk_size=8, mesh=mesh)
  assert_equal_functions(fast, slow, args)


@pytest.mark.slow  # the kernel interpreted: ~20 s
def test_pallas_kernel_interpreted_equals_the_recurrence():
  args, ids = case(T=40, seed=4)
  fast, slow = op_and_reference(ids, chunk_size=8, impl="pallas", interpret=True)
  assert_equal_functions(fast, slow, args)


def test_bad_input_names_the_argument():
  (q, k, v, g, _), _ = case()
  with pytest.raises(ValueError, match=r"^g has shape"):
    recurrent.gated_linear_rule(q, k, v, g[:, :-1])
  with pytest.raises(ValueError, match=r"^chunk_size=0 must be a positive integer"):
    functools.partial(recurrent.gated_linear_rule, chunk_size=0)(q, k, v, g)
