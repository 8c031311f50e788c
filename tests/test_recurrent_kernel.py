"""The gated delta rule's Pallas state-scan kernels (`impl='pallas'`), in Pallas interpret mode on
CPU against the per-token recurrence (test_recurrent.py), forward and every gradient; per shard
under a mesh, inside the context-parallel op, and compiled by Mosaic for a TPU target."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import fast_first
from efficient_lm.ops import recurrent
from test_kernel_splash import tpu_mesh
from test_recurrent import assert_close, assert_same_function, documents, inputs
from test_recurrent_ring import assert_same_on_mesh, mesh_of

kernel_op = functools.partial(recurrent.gated_delta_rule, impl="pallas", interpret=True)


def test_equals_recurrence_with_documents_at_a_ragged_length():
  B, T, H, K, V = 2, 45, 2, 8, 6
  args = inputs(B, T, H, K, V, seed=31)
  initial = 0.5 * jax.random.normal(jax.random.key(31), (B, H, K, V))
  assert_same_function(kernel_op, (*args, initial), chunk_size=16,
                       segment_ids=documents(B, T, seed=31))


@pytest.mark.parametrize("B,T,H,K,V,chunk", fast_first([
    (1, 64, 1, 16, 16, 16),   # T a multiple of the chunk
    (1, 5, 2, 4, 4, 64),      # one chunk (chunk_size > T)
    (2, 70, 2, 8, 12, 8),     # many chunks, V != K
], keep=1))
def test_random_shapes(B, T, H, K, V, chunk):
  args = inputs(B, T, H, K, V, seed=T)
  assert_same_function(kernel_op, args, chunk_size=chunk, segment_ids=documents(B, T, seed=T))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_per_shard_under_a_mesh():
  """Under a mesh with the batch over `data` and the heads over `tensor`, each device runs the
  kernel on its own rows and heads: equal to the xla op, values and gradients, no all-gather."""
  mesh = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)  # as sharding.make_mesh
  B, T, H, K, V = 2, 24, 2, 8, 8
  args = inputs(B, T, H, K, V, seed=32)

  def run(impl):
    def loss(*a):
      o, final = recurrent.gated_delta_rule(*a, impl=impl, interpret=True, chunk_size=8)
      return jnp.sum(jnp.sin(o)) + jnp.sum(final ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))

  with jax.set_mesh(mesh):
    spread = [jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor"))) for x in args]
    step = run("pallas")
    got = step(*spread)
    assert "all-gather" not in step.lower(*spread).compile().as_text()
  want = run("xla")(*args)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert_close(a, b)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_context_parallel_with_the_kernel():
  B, T, H, K, V = 2, 32, 2, 8, 8
  args = inputs(B, T, H, K, V, seed=33)
  initial = jax.random.normal(jax.random.key(33), (B, H, K, V))
  assert_same_on_mesh(mesh_of(1, 4), (*args, initial), chunk_size=4, impl="pallas",
                      interpret=True, segment_ids=documents(B, T, seed=33))


def test_off_a_tpu_it_runs_only_interpreted():
  args = inputs(1, 8, 1, 4, 4)
  with pytest.raises(ValueError, match="impl='pallas' runs .* TPU .* interpret=True"):
    recurrent.gated_delta_rule(*args, impl="pallas")


def test_compiles_for_tpu_per_shard_without_gathering():
  """fwd + bwd compiled for a 4-chip v5e with the batch over fsdp: Mosaic lowers the two
  kernels (the forward and the reverse scan), nothing is all-gathered."""
  mesh = tpu_mesh()
  B, T, H, K = 4, 1024, 2, 64
  qkv = jax.ShapeDtypeStruct((B, T, H, K), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
  rows = jax.ShapeDtypeStruct((B, T, H), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))

  def step(*a):
    def loss(*a):
      o, final = recurrent.gated_delta_rule(*a, impl="pallas")
      return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*a)

  with jax.set_mesh(mesh):
    hlo = jax.jit(step).lower(qkv, qkv, qkv, rows, rows).compile().as_text()
  assert hlo.count('custom_call_target="tpu_custom_call"') == 2
  assert "all-gather" not in hlo
