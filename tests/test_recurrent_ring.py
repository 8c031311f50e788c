"""The gated delta rule with the sequence sharded over a `context` mesh axis (8 fake CPU devices,
conftest sets XLA_FLAGS) against the single-device op, itself tested against the per-token
recurrence (test_recurrent.py): outputs, final state and every gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first
from efficient_lm.ops import recurrent
from test_recurrent import assert_close, documents, inputs, reference, values_and_grads

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def mesh_of(data: int, context: int, tensor: int = 1) -> jax.sharding.Mesh:
  return jax.make_mesh((data, context, tensor), ("data", "context", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=jax.devices()[:data * context * tensor])


def assert_same_on_mesh(mesh, args, rtol=1e-5, **kw):
  """Sharded equals one device (and both the recurrence): outputs, final state and gradients of
  <o, c_o> + <final, c_s> with respect to q, k, v, g, beta and the initial state."""
  B, _, H, K = args[0].shape
  V = args[2].shape[-1]
  keys = jax.random.split(jax.random.key(99), 2)
  cot_o = jax.random.normal(keys[0], args[2].shape)
  cot_s = jax.random.normal(keys[1], (B, H, K, V))
  op = lambda *a, **extra: recurrent.gated_delta_rule(*a[:5], initial_state=a[5], **kw, **extra)
  sharded = values_and_grads(functools.partial(op, mesh=mesh), args, cot_o, cot_s)
  single = values_and_grads(op, args, cot_o, cot_s)
  ids = kw.get("segment_ids")
  o_ref, final_ref = reference(*args[:5], initial_state=args[5], segment_ids=ids,
                               scale=kw.get("scale"))
  assert_close(single[0], o_ref, rtol)
  assert_close(sharded[0], single[0], rtol)
  assert_close(sharded[1], single[1], rtol)
  assert_close(sharded[1], final_ref, rtol)
  for name, g, w in zip("q k v g beta initial_state".split(), sharded[2], single[2]):
    assert np.all(np.isfinite(g)), name
    assert_close(g, w, rtol)


def test_four_devices_equal_one_with_documents():
  """The measured goal: T = 48 over 4 devices (12 tokens each, chunks of 8: a ragged chunk per
  device), documents that start inside a device, exactly at a device boundary, and one that
  spans three devices; an initial state."""
  B, T, H, K, V = 2, 48, 2, 8, 6
  args = inputs(B, T, H, K, V, seed=21)
  ids = np.zeros((B, T), np.int32)
  ids[0] = np.repeat([0, 1, 2, 3], [5, 7, 30, 6])   # starts at 5, 12 (a device boundary), 42
  ids[1] = np.repeat([4, 4, 5, 6], [10, 10, 3, 25])  # a 3-token document, one across 2 devices
  initial = 0.5 * jax.random.normal(jax.random.key(21), (B, H, K, V))
  assert_same_on_mesh(mesh_of(1, 4), (*args, initial), chunk_size=8,
                      segment_ids=jnp.asarray(ids))


@pytest.mark.parametrize("data, context, tensor, T, chunk", fast_first([
    (1, 8, 1, 32, 64),   # 4 tokens per device, chunk_size > a device's tokens
    (2, 4, 1, 40, 4),    # batch over data too
    (1, 2, 2, 24, 5),    # heads over tensor
], keep=1))
def test_meshes_equal_one_device(data, context, tensor, T, chunk):
  B, H, K, V = 2, 2, 8, 8
  args = inputs(B, T, H, K, V, seed=T)
  initial = jax.random.normal(jax.random.key(T), (B, H, K, V))
  assert_same_on_mesh(mesh_of(data, context, tensor), (*args, initial), chunk_size=chunk,
                      segment_ids=documents(B, T, seed=T), scale=0.6)


def test_without_documents_or_initial_state():
  B, T, H, K, V = 1, 32, 2, 8, 8
  args = inputs(B, T, H, K, V, seed=22)
  mesh = mesh_of(1, 4)
  o, final = jax.jit(functools.partial(recurrent.gated_delta_rule, chunk_size=4, mesh=mesh))(*args)
  want_o, want_final = reference(*args)
  assert_close(o, want_o)
  assert_close(final, want_final)


def test_a_one_device_mesh_is_the_single_device_op():
  args = inputs(1, 12, 1, 4, 4, seed=23)
  o, final = recurrent.gated_delta_rule(*args, mesh=mesh_of(1, 1), chunk_size=4)
  want_o, want_final = recurrent.gated_delta_rule(*args, chunk_size=4)
  np.testing.assert_array_equal(o, want_o)
  np.testing.assert_array_equal(final, want_final)


@pytest.mark.parametrize("T, axis_name, message", [
    (30, "context", "T=30 must be divisible by the 4 devices"),
    (32, "sequence", "axis_name='sequence' is not an axis of the mesh"),
])
def test_bad_sharding_is_refused(T, axis_name, message):
  args = inputs(1, T, 1, 4, 4)
  with pytest.raises(ValueError, match=message):
    recurrent.gated_delta_rule(*args, mesh=mesh_of(1, 4), axis_name=axis_name)
