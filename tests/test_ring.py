"""Context-parallel (ring) ops on 8 fake CPU devices (conftest sets XLA_FLAGS) against the single-device ops.

Each ring op takes global arrays whose T axis is sharded over the mesh's
`context` axis; it must equal its single-device twin forward and in every
gradient, for windows and periods that cross one or several devices. The
single-device ops are themselves tested against dense masked references
(test_local_attention.py, test_attention.py, test_memory.py).
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import build, fast_first, load_config
from efficient_lm import models
from efficient_lm.config.errors import ConfigError
from efficient_lm.models import chunking
from efficient_lm.ops import attention
from efficient_lm.ops import memory
from efficient_lm.ops import ring
from efficient_lm.ops import route
from efficient_lm.ops.pattern import Pattern
from efficient_lm.training import loop as train
from efficient_lm.state import train_state
from efficient_lm.training import evaluate as training_evaluate
from efficient_lm.training import step as train_step
from efficient_lm.training import prepare as config_check

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")

T = 32


def mesh_of(data: int, context: int) -> jax.sharding.Mesh:
  return jax.make_mesh((data, context), ("data", "context"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:data * context])


def inputs(B=2, H=2, K=8, seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  q, k, v = (jax.random.normal(key, (B, T, H, K), jnp.float32) for key in keys[:3])
  # Moderate gates: where no skip is present the gate's exact gradient is 0, and its rounding
  # noise grows like 1 / gate (gates near 0 and 1 are tested on one device).
  gate = jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, H)))
  cotangent = jax.random.normal(keys[4], (B, T, H, K), jnp.float32)
  return q, k, v, gate, cotangent


def assert_same_function(fast, reference, args, cotangent, atol=2e-5):
  """Equal outputs and equal gradients of <output, cotangent> with respect to every argument."""
  def value_and_grads(op):
    loss = lambda *a: jnp.sum(op(*a) * cotangent)
    return jax.jit(lambda *a: (op(*a), jax.grad(loss, argnums=tuple(range(len(a))))(*a)))(*args)

  out, grads = value_and_grads(fast)
  ref_out, ref_grads = value_and_grads(reference)
  np.testing.assert_allclose(out, ref_out, atol=atol, rtol=1e-5)
  for g, ref_g in zip(grads, ref_grads):
    np.testing.assert_allclose(g, ref_g, atol=atol, rtol=1e-5)


# 8 devices along the sequence: C = 4 tokens each.
@pytest.mark.parametrize("window, period, num_skips", fast_first([
    (3, 2, 4),    # period below C; skips inside the window are dropped
    (2, 9, 3),    # period over two devices, not a multiple of C; the farthest skips pass the start
    (11, 3, 6),   # window wider than two devices' chunks, with skips
], keep=(1, 2)))
def test_pi_attention_equals_single_device(window, period, num_skips):
  q, k, v, gate, cotangent = inputs()
  kw = dict(window=window, period=period, num_skips=num_skips)
  assert_same_function(functools.partial(attention.pi_attention, mesh=mesh_of(1, 8), **kw),
                       functools.partial(attention.pi_attention, **kw), (q, k, v, gate), cotangent)


@pytest.mark.parametrize("window", [3, 11, 40])  # inside one device, over three, wider than T
def test_sliding_window_equals_single_device(window):
  q, k, v, _, cotangent = inputs()
  assert_same_function(
      functools.partial(attention.sliding_window_attention, window=window, mesh=mesh_of(1, 8)),
      functools.partial(attention.sliding_window_attention, window=window), (q, k, v), cotangent)


# A data x context mesh (2 x 4): the batch sharded too, C = 8.
@pytest.mark.parametrize("block_size, lookback", [(4, 0), (2, 1), (8, 1), (4, 3)])
def test_block_local_attention_equals_single_device(block_size, lookback):
  q, k, v, _, cotangent = inputs()
  kw = dict(block_size=block_size, lookback=lookback)
  assert_same_function(functools.partial(attention.block_local_attention, mesh=mesh_of(2, 4), **kw),
                       functools.partial(attention.block_local_attention, **kw), (q, k, v), cotangent)


@pytest.mark.parametrize("layout", fast_first(["natural", "zigzag"]))
def test_ring_causal_attention_equals_dense(layout):
  q, k, v, _, cotangent = inputs()
  n = 4
  to, back = (lambda x: ring.to_layout(x, n, layout)), (lambda x: ring.from_layout(x, n, layout))
  fast = lambda q, k, v: back(attention.causal_attention(to(q), to(k), to(v), mesh=mesh_of(2, n),
                                                    layout=layout))
  assert_same_function(fast, attention.causal_attention, (q, k, v), cotangent)


def test_zigzag_layout_round_trip_and_positions():
  positions = ring.layout_positions(16, 2, "zigzag")
  np.testing.assert_array_equal(positions, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
  x = np.arange(32).reshape(2, 16)
  np.testing.assert_array_equal(ring.from_layout(ring.to_layout(x, 2, "zigzag"), 2, "zigzag"), x)
  batch = {"inputs": x, "targets": x + 1, "weights": np.ones((2, 16), np.float32)}
  laid = ring.permute_batch(batch, 2, "zigzag")
  np.testing.assert_array_equal(laid["positions"][1], positions)
  np.testing.assert_array_equal(laid["targets"] - laid["inputs"], 1)  # pairs stay together


def test_exponential_memory_equals_single_device(alpha=0.8):
  s = jax.random.normal(jax.random.key(1), (2, 16, 6), jnp.float32)  # 16 blocks over 8 devices
  cotangent = jax.random.normal(jax.random.key(2), s.shape, jnp.float32)
  assert_same_function(
      lambda s: ring.exponential_memory(s, alpha, mesh=mesh_of(1, 8)),
      lambda s: memory.exponential_memory(s, alpha), (s,), cotangent)


def test_shift_right_equals_single_device():
  x = jax.random.normal(jax.random.key(3), (2, T, 3), jnp.float32)
  for distance in (1, 4, 9):
    np.testing.assert_array_equal(ring.shift_right(x, distance, mesh=mesh_of(1, 8)),
                                  route.shift_right(x, distance))


def test_sharded_pi_attention_permutes_and_never_gathers():
  q, k, v, gate, _ = inputs()
  op = functools.partial(attention.pi_attention, window=3, period=9, num_skips=3, mesh=mesh_of(1, 8))
  loss = lambda *a: jnp.sum(op(*a))
  hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(q, k, v, gate).compile().as_text()
  assert "collective-permute" in hlo
  assert "all-gather" not in hlo and "all-to-all" not in hlo


def test_bad_shapes_are_named():
  q, k, v, _, _ = inputs()
  with pytest.raises(ValueError, match="T=32 must be divisible by the 3 devices"):
    attention.sliding_window_attention(q, k, v, window=3, mesh=mesh_of(1, 3))
  with pytest.raises(ValueError, match="block_size=8 must divide the 4 tokens"):
    attention.block_local_attention(q, k, v, block_size=8, mesh=mesh_of(1, 8))
  with pytest.raises(ValueError, match="zigzag layout needs T=32 divisible by 2 \\* devices = 64"):
    ring.layout_positions(32, 32, "zigzag")


@pytest.mark.parametrize("pattern", [Pattern.sliding(5), Pattern.blocks(4, 1), Pattern.blocks(8),
                                     Pattern.segments(8), Pattern.pi(4, 6, 3), Pattern.pi(3, 8, 2)],
                         ids=repr)
def test_halo_is_the_farthest_key_a_chunk_sees(pattern):
  """`ring.halo` (the ring's halo and a chunked block's, `chunking.halo`) against a brute force:
  over every chunk of a sequence, its first query's position minus the lowest key any of its
  queries sees (`Pattern.visible`); the ring's is capped at T - chunk, a chunked block's is the
  pattern's alone (far from the start, nothing clipped)."""
  seen = np.asarray(pattern.visible(np.arange(T)[:, None], np.arange(T)[None]))
  for chunk in (8, 16):
    starts = range(0, T, chunk)
    farthest = max(s - np.flatnonzero(seen[s:s + chunk].any(axis=0)).min() for s in starts)
    assert ring.halo(pattern, chunk, T) == farthest, chunk
    long = 4 * (pattern.reach + chunk)  # a sequence long enough that no chunk is clipped at 0
    far = np.asarray(pattern.visible(np.arange(long)[:, None], np.arange(long)[None]))
    unclipped = max(s - np.flatnonzero(far[s:s + chunk].any(axis=0)).min()
                    for s in range(0, long, chunk))
    assert ring.halo(pattern, chunk) == chunking.halo((pattern, Pattern.sliding(1)), chunk)
    assert ring.halo(pattern, chunk) == unclipped, chunk
  with pytest.raises(ValueError, match=r"unbounded reach .* \(set model.seq_chunk=0"):
    chunking.halo(Pattern.dense(), 8)


def test_route_is_chosen_by_the_mesh():
  """A model's route shards the sequence only on a context axis of several devices, in the layout
  its patterns need (dense: zig-zag ring attention; bounded reach: natural, halos)."""
  routes = lambda name, mesh: {m.route for _, m in models.create(
      build(tiny_model_config(name)).model, rngs=nnx.Rngs(0), mesh=mesh).iter_modules()
      if hasattr(m, "route")}
  for mesh in (None, mesh_of(8, 1)):
    assert {r.mesh for r in routes("dense", mesh)} == {None}
  (dense,) = routes("dense", mesh_of(2, 4))
  assert dense.context == 4 and dense.layout == "zigzag"
  (pi,) = routes("pi_attention", mesh_of(2, 4))
  assert pi.context == 4 and pi.layout == "natural"


@pytest.mark.parametrize("name, overrides, message", [
    ("perceiver_ar", {"num_latents": 16}, "mesh.context=4 > 1 is not supported for model.name='perceiver_ar'"),
    ("bcmt", {"block_size": 16}, "mesh.context=4 leaves 8 tokens per device, not a multiple of "
     "bcmt's attention block of 16 tokens"),
    ("ecp", {"num_segments": 2}, "mesh.context=4 leaves 8 tokens per device, not a multiple of "
     "ecp's attention block of 16 tokens"),
])
def test_unsupported_context_configs_are_named(name, overrides, message):
  config = tiny_model_config(name)
  config.model.update(overrides)
  config.mesh.update(data=1, context=4)
  with pytest.raises(ConfigError) as error:
    config_check.validate(build(config))
  assert str(error.value).startswith(message), str(error.value)
  assert ";" in str(error.value)


# Training: a few steps with mesh.context=4 reach the losses of one device.

def tiny_model_config(name: str) -> ml_collections.ConfigDict:
  config = load_config(name)
  config.data.update(seq_len=T, batch_size=2, vocab_size=300)
  config.model.update(d_model=16, num_layers=2, num_heads=2, mlp_ratio=2)
  if name == "pi_attention":
    config.model.update(window=4, period=6, num_skips=3, gate_hidden=8)
  if name == "bcmt":
    config.model.update(block_size=4)
  if name == "ecp":
    config.model.update(num_segments=4)
  if name == "gated_deltanet":  # chunks of 4 inside each device's 8 tokens; a window layer
    config.model.update(conv_size=3, chunk_size=4, hybrid_every=2, window=4)
  return config


def train_losses(config, mesh, num_steps=3):
  model = models.create(build(config).model, rngs=nnx.Rngs(0), mesh=mesh)
  layout = models.sequence_layout(build(config).model, mesh)
  graphdef, params = nnx.split(model)
  tx = optax.adam(1e-2)
  state = train_state.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.P()))
  step_fn = train_step.make_train_step(graphdef, tx, lambda step: 1e-2, seed=0)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 300, (2, T + 1), dtype=np.int32)
  weights = (rng.random((2, T)) > 0.2).astype(np.float32)  # some positions unscored
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}
  losses = []
  for _ in range(num_steps):  # the same batch again: the loss must fall
    state, metrics = step_fn(state, training_evaluate.place_batch(batch, mesh, layout))
    losses.append(float(metrics["loss"]))
  return losses


@pytest.mark.parametrize("name", fast_first(["pi_attention", "dense", "bcmt", "ecp", "gated_deltanet"],
                                            keep=0))
def test_context_parallel_training_matches_one_device(name):
  config = tiny_model_config(name)
  one = train_losses(config, mesh_of(1, 1))
  parallel = train_losses(config, mesh_of(1, 4))
  assert one[-1] < one[0]  # it trains
  np.testing.assert_allclose(parallel, one, rtol=2e-5)


@pytest.mark.slow
def test_train_and_evaluate_with_context_parallelism(tiny_config, tmp_path):
  """The whole loop with mesh.context=4 (dense: zig-zag batches in training and eval, checkpoints,
  the sample on one device) ends where one device does."""
  summaries = []
  for context in (1, 4):
    config = tiny_config("dense", num_steps=10, eval_every=10, checkpoint_every=10)
    config.mesh.update(data=1, context=context)
    summaries.append(train.train_and_evaluate(build(config), str(tmp_path / f"context_{context}")))
  one, parallel = summaries
  assert parallel["step"] == 10 and parallel["sample"].startswith("ROMEO:")
  assert parallel["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-4)
