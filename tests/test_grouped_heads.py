"""Grouped-query attention (`model.num_kv_heads`): k and v with fewer heads than q, every backend.

The reference is the dense masked softmax with k and v *repeated* to the query heads (query head h
reads key/value head h // G): the public ops, the core's chunk / cache calls, the ring and the
kernels per shard must equal it in values and every gradient, without repeating k or v themselves
(their compiled memory shrinks with them). Then the models: every family takes the field (fewer
parameters, causal), dense `configs/dense.py:mqa` trains, its decoding cache per row is 1 /
num_heads of the default's, and configs written before the field load with as many as num_heads.
(Decoding equals the full pass with grouped heads in every family: tests/families/ `DECODING`,
test_decoding.py and test_perceiver_decoding.py.)
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file

from conftest import build, fast_first, load_config

import efficient_lm
from efficient_lm import models
from efficient_lm.config import base as config_base
from efficient_lm.config.errors import ConfigError
from efficient_lm.config.run import RunConfig
from efficient_lm.inference import export
from efficient_lm import families
from efficient_lm.ops import attention, core, ring
from efficient_lm.ops.core import backends, kernel_mesh
from efficient_lm.ops.pattern import Pattern
from efficient_lm.parallel import sharding
from efficient_lm.state import train_state
from efficient_lm.training import loop as train
from efficient_lm.training import prepare as config_check
from test_core import reference_attend, reference_masks, value_and_grads
from test_models import tiny_model_config

H, KV_HEADS = 4, 2  # the measured goal's shape: 4 query heads, 2 key/value heads


def grouped_inputs(B=2, T=24, heads=H, kv_heads=KV_HEADS, K=8, seed=0, segments=True):
  """q `[B, T, heads, K]`, k and v `[B, T, kv_heads, K]`, a gate `[B, T, heads]`, an o cotangent,
  and document ids (two documents in row 0, three in row 1) or None."""
  keys = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(keys[0], (B, T, heads, K))
  k, v = (jax.random.normal(key, (B, T, kv_heads, K)) for key in keys[1:3])
  gate = jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, heads)))
  cotangent = jax.random.normal(keys[4], (B, T, heads, K))
  ids = None
  if segments:
    bounds = np.array([[T // 3, T], [T // 4, T // 2]])
    ids = jnp.asarray((np.arange(T)[None, :, None] >= bounds[:, None, :]).sum(-1), jnp.int32)
  return q, k, v, gate, cotangent, ids


def repeated(x, heads=H):
  """k or v repeated to the query heads: what the reference reads (never the op)."""
  return jnp.repeat(x, heads // x.shape[2], axis=2)


def outputs_and_grads(op, args, cotangent):
  """op(*args) and the gradients of <op(*args), cotangent> in every argument, jitted."""
  loss = lambda *a: jnp.sum(op(*a).astype(jnp.float32) * cotangent)
  return jax.jit(lambda *a: (op(*a), jax.grad(loss, argnums=tuple(range(len(a))))(*a)))(*args)


def assert_equal_to_repeated(op, args, cotangent, atol=2e-5, **reference_kw):
  """`op(q, k, v, *rest)` against `op` on the reference backend with k, v repeated: values, and
  the gradients of q, k, v (the repeated reference's k / v gradient summed over each group) and of
  the rest."""
  reference = lambda q, k, v, *rest: op(q, repeated(k), repeated(v), *rest, **reference_kw)
  out, grads = outputs_and_grads(op, args, cotangent)
  ref_out, ref_grads = outputs_and_grads(reference, args, cotangent)
  np.testing.assert_allclose(out, ref_out, atol=atol, rtol=atol)
  assert grads[1].shape == args[1].shape and grads[2].shape == args[2].shape
  for g, ref_g in zip(grads, ref_grads):
    np.testing.assert_allclose(g, ref_g, atol=10 * atol, rtol=10 * atol)


# The public ops, every backend (the kernels in Pallas interpret mode), with documents.

OPS = [
    ("causal", attention.causal_attention, {}),
    ("block_local", attention.block_local_attention, dict(block_size=8, lookback=1)),
    ("sliding_window", attention.sliding_window_attention, dict(window=5)),
    ("pi", attention.pi_attention, dict(window=4, period=6, num_skips=2)),      # skips as shifts
    ("pi_rows", attention.pi_attention, dict(window=3, period=2, num_skips=8)),  # the row call
]
IMPLS = ["xla", "reference", "splash", "gpu"]
OP_CASES = [(name, impl) for impl in IMPLS for name, _, _ in OPS]
FAST = {("causal", "xla"), ("pi", "xla"), ("pi_rows", "xla"), ("block_local", "xla"),
        ("sliding_window", "reference"), ("causal", "splash"), ("pi", "gpu")}


@pytest.mark.parametrize("name,impl", fast_first(
    OP_CASES, keep=[i for i, case in enumerate(OP_CASES) if case in FAST]))
def test_public_ops_equal_the_reference_with_kv_repeated(name, impl):
  """4 query heads over 2 key/value heads, documents in both rows: o and every gradient equal
  the reference's with k, v repeated; a kernel backend runs its kernel (no call falls back)."""
  _, op, kw = next(case for case in OPS if case[0] == name)
  q, k, v, gate, cotangent, ids = grouped_inputs(T=29 if impl == "xla" else 24, seed=len(name))
  interpret = impl in ("splash", "gpu")
  fast = functools.partial(op, impl=impl, interpret=interpret, segment_ids=ids, **kw)
  args = (q, k, v, gate) if op is attention.pi_attention else (q, k, v)
  with backends.recorded() as record:
    assert_equal_to_repeated(fast, args, cotangent, impl="reference", interpret=False)
  if interpret:
    assert record["kernel_calls"] and not record["fallbacks"], record


def test_multi_query_with_bfloat16():
  """One key/value head for 4 query heads, bfloat16: o in bfloat16, close to the float32
  reference with k, v repeated."""
  q, k, v, gate, cotangent, _ = grouped_inputs(kv_heads=1, T=40, segments=False)
  kw = dict(window=6, period=5, num_skips=3)
  bf16 = lambda x: x.astype(jnp.bfloat16)
  out, grads = outputs_and_grads(lambda *a: attention.pi_attention(*map(bf16, a[:3]), a[3], **kw),
                                 (q, k, v, gate), cotangent)
  ref, ref_grads = outputs_and_grads(
      lambda q, k, v, g: attention.pi_attention(q, repeated(k), repeated(v), g, impl="reference",
                                                **kw), (q, k, v, gate), cotangent)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=3e-2, rtol=3e-2)
  for g, ref_g in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(g, np.float32), ref_g, atol=0.15, rtol=0.1)


# The core's other modes: a chunk's key window at a traced start, a decoding cache's explicit
# key positions (heads-first, empty slots), priors and an lse cotangent.

CORE_CASES = [
    # (pattern, Tq, Tk, q_start, k_start, traced, explicit positions, layout)
    (Pattern.sliding(5), 9, 40, 20, 0, True, False, "BTHK"),
    (Pattern.blocks(4, 1), 12, 30, 13, 2, False, False, "BHTK"),
    (Pattern.pi(4, 6, 3), 16, 40, 24, 0, False, False, "BTHK"),  # priors on both parts
    (Pattern.dense(), 3, 12, 9, 0, True, True, "BHTK"),          # a cache: slots, some empty
    (Pattern.pi(3, 4, 3), 1, 12, 11, 0, True, True, "BHTK"),     # π's step over its cache
]


@pytest.mark.parametrize("case", fast_first([pytest.param(c, id=f"case{i}")
                                             for i, c in enumerate(CORE_CASES)], keep=(0, 3)))
def test_core_modes_equal_the_reference_with_kv_repeated(case):
  pattern, Tq, Tk, q_start, k_start, traced, explicit, layout = case
  keys = jax.random.split(jax.random.key(Tq + Tk), 7)
  B = 2
  q = jax.random.normal(keys[0], (B, Tq, H, 8))
  k, v = (jax.random.normal(key, (B, Tk, KV_HEADS, 8)) for key in keys[1:3])
  lp, sp = (jax.random.normal(key, (B, Tq, H)) if pattern.has_skips else None for key in keys[3:5])
  cotangents = (jax.random.normal(keys[5], (B, Tq, H, 8)), jax.random.normal(keys[6], (B, Tq, H)))
  positions = None
  if explicit:  # a ring of Tk slots: the last Tk - 3 positions up to q_start, 3 slots empty
    positions = np.full(Tk, -1)
    last = np.arange(max(0, q_start + Tq - Tk + 3), q_start + Tq)
    positions[last % Tk] = last
  k_pos = k_start + np.arange(Tk) if positions is None else positions
  local, skip = reference_masks(pattern, q_start + np.arange(Tq), k_pos)
  heads = (lambda x: None if x is None else jnp.swapaxes(x, 1, 2)) if layout == "BHTK" else (
      lambda x: x)

  def fast(q, k, v, lp, sp, qs, ks):
    o, lse = core.attend(heads(q), heads(k), heads(v), pattern, q_start=qs, k_start=ks,
                         k_positions=None if positions is None else jnp.asarray(positions),
                         local_prior=heads(lp), skip_prior=heads(sp), layout=layout)
    return heads(o), heads(lse)

  starts = (jnp.int32(q_start), jnp.int32(k_start)) if traced else (q_start, k_start)
  args = (q, k, v, lp, sp)
  got = jax.jit(lambda *a: value_and_grads(lambda *b: fast(*b, *starts), a, cotangents))(*args)
  want = jax.jit(lambda *a: value_and_grads(
      lambda q, k, v, lp, sp: reference_attend(q, repeated(k), repeated(v), local, skip, lp, sp),
      a, cotangents))(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape
    np.testing.assert_allclose(g, w, atol=2e-4, rtol=2e-4)


def test_fewer_kv_heads_must_divide_the_query_heads():
  q = jnp.zeros((1, 8, 4, 8))
  for kv_heads in (3, 8):
    k = jnp.zeros((1, 8, kv_heads, 8))
    with pytest.raises(ValueError, match="a number of heads dividing q's"):
      attention.causal_attention(q, k, k)


def test_no_copy_of_k_and_v_per_query_head():
  """fwd + bwd of causal attention with 8 query heads on the XLA core: the compiled memory that
  grows with T (temporaries and outputs, from T = 2,048 to 4,096) is smaller with 1 key/value head
  than with 8 by more than k and v of the 7 heads it lacks: they are never repeated to the query
  heads. (Measured: 25.3 against 56.3 units of T K float32 per token of T; the per-block
  temporaries, which do not grow with T, are a few MiB either way.)"""
  K = 64

  def compiled_bytes(kv_heads, T):
    q = jax.ShapeDtypeStruct((1, T, 8, K), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, T, kv_heads, K), jnp.float32)
    step = jax.grad(lambda q, k, v: jnp.sum(attention.causal_attention(q, k, v) ** 2),
                    argnums=(0, 1, 2))
    analysis = jax.jit(step).lower(q, kv, kv).compile().memory_analysis()
    return analysis.temp_size_in_bytes + analysis.output_size_in_bytes

  growth = lambda kv_heads: compiled_bytes(kv_heads, 4096) - compiled_bytes(kv_heads, 2048)
  assert growth(1) < growth(8) - 2 * 7 * 2048 * K * 4


# The ring: k and v travel with their own (fewer) heads.

def mesh_of(**sizes) -> jax.sharding.Mesh:
  names = tuple(sizes)
  count = int(np.prod(list(sizes.values())))
  return jax.make_mesh(tuple(sizes.values()), names, axis_types=(jax.sharding.AxisType.Auto,) * len(names),
                       devices=jax.devices()[:count])


RING_CASES = [
    ("pi", dict(data=1, context=8), KV_HEADS, "natural"),
    ("causal", dict(data=2, context=4), KV_HEADS, "zigzag"),
    ("block_local", dict(data=2, context=4), 1, "natural"),
    # Heads split over `tensor`: 2 key/value heads split with the 4 query heads, 1 stays whole
    # (each device takes the one its query heads share).
    ("causal", dict(tensor=2, context=4), KV_HEADS, "zigzag"),
    ("pi", dict(tensor=2, context=4), 1, "natural"),
]


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize("name,sizes,kv_heads,layout", fast_first(RING_CASES, keep=(1, 4)),
                         ids=str)
def test_ring_equals_one_device(name, sizes, kv_heads, layout):
  _, op, kw = next(case for case in OPS if case[0] == name)
  q, k, v, gate, cotangent, _ = grouped_inputs(T=32, kv_heads=kv_heads, segments=False)
  mesh = mesh_of(**sizes)
  n = mesh.shape["context"]
  to, back = (lambda x: ring.to_layout(x, n, layout)), (lambda x: ring.from_layout(x, n, layout))
  extra = dict(layout=layout) if name == "causal" else {}
  args = (q, k, v, gate) if op is attention.pi_attention else (q, k, v)

  def sharded(q, k, v, *gate):
    return back(op(to(q), to(k), to(v), *map(to, gate), mesh=mesh, **extra, **kw))

  one = functools.partial(op, **kw)
  out, grads = outputs_and_grads(sharded, args, cotangent)
  ref_out, ref_grads = outputs_and_grads(one, args, cotangent)
  np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=1e-5)
  for g, ref_g in zip(grads, ref_grads):
    np.testing.assert_allclose(g, ref_g, atol=2e-5, rtol=1e-5)


# A kernel per shard with the heads split over `tensor`.

@pytest.mark.parametrize("impl,kv_heads", fast_first([("splash", 1), ("gpu", KV_HEADS)]))
def test_kernel_per_shard_with_heads_split(impl, kv_heads):
  """Batch over `data`, the 4 query heads over `tensor=2`: 2 key/value heads split with them,
  1 stays whole on each device (its query heads' one taken there); values and gradients equal
  the unsharded reference with k, v repeated."""
  mesh = mesh_of(data=2, fsdp=1, tensor=2, context=1)
  q, k, v, gate, cotangent, _ = grouped_inputs(T=24, kv_heads=kv_heads, segments=False, seed=7)
  kw = dict(window=4, period=6, num_skips=2)
  op = functools.partial(attention.pi_attention, impl=impl, interpret=True, **kw)
  with jax.set_mesh(mesh):
    spread = [jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor"))
                             if x.shape[2] % 2 == 0 else NamedSharding(mesh, P("data")))
              for x in (q, k, v, gate)]
    out, grads = outputs_and_grads(op, spread, cotangent)
  ref, ref_grads = outputs_and_grads(
      lambda q, k, v, g: attention.pi_attention(q, repeated(k), repeated(v), g, impl="reference",
                                                **kw), (q, k, v, gate), cotangent)
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
  for g, ref_g in zip(grads, ref_grads):
    np.testing.assert_allclose(g, ref_g, atol=2e-4, rtol=2e-4)


def test_splash_compiles_for_tpu_with_grouped_heads():
  """fwd + bwd of a π call with 4 query heads compiled for a 4-chip v5e (libtpu's topology, no TPU
  needed), the batch over fsdp and the heads over tensor: with 2 key/value heads (split with the
  query heads) and 1 (whole on each chip), Mosaic lowers splash's forward, dkv and dq kernels and
  nothing is all-gathered."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    topology = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    mesh = topologies.make_mesh(topology, (1, 2, 2, 1), ("data", "fsdp", "tensor", "context"))
  except Exception as error:  # pylint: disable=broad-except
    pytest.skip(f"libtpu cannot give a TPU topology on this host ({type(error).__name__}: {error})")
  B, T, K = 4, 384, 128
  spec = lambda x, heads: jax.ShapeDtypeStruct(
      x, jnp.bfloat16 if len(x) == 4 else jnp.float32,
      sharding=NamedSharding(mesh, P(*("fsdp", None, heads, None)[:len(x)])))
  pattern = Pattern.pi(64, 96, 2)

  def step(*args):
    def loss(q, k, v, lp, sp):
      o, lse = core.attend(q, k, v, pattern, local_prior=lp, skip_prior=sp, impl="splash")
      return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(lse)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*args)

  for kv_heads in (2, 1):
    kv = spec((B, T, kv_heads, K), "tensor" if kv_heads == 2 else None)
    rows = spec((B, T, H), "tensor")
    with jax.set_mesh(mesh):
      hlo = jax.jit(step).lower(spec((B, T, H, K), "tensor"), kv, kv, rows, rows).compile().as_text()
    assert hlo.count('custom_call_target="tpu_custom_call"') == 3, kv_heads
    assert "all-gather" not in hlo, kv_heads


def test_query_heads_spanning_two_groups_on_one_device_are_named():
  """6 query heads over 3 key/value heads, split over 2 devices: device 0's query heads 0..2 read
  key/value heads 0 and 1, which no single key/value head serves."""
  assert not kernel_mesh.whole_kv_heads(4, 2, 2)   # split with the query heads
  assert kernel_mesh.whole_kv_heads(4, 1, 2)       # whole: each device's 2 share head 0
  with pytest.raises(ValueError, match="multiple of 2"):
    kernel_mesh.whole_kv_heads(6, 3, 2)


# The parameters on a mesh: the key/value heads split over `tensor` like the query heads.

def with_kv_heads(run: RunConfig, kv_heads: int, rule: str | None = None) -> RunConfig:
  """`run` with `model.num_kv_heads=kv_heads` (and `mesh.rules.kv_heads=rule`): a new RunConfig,
  every check run again."""
  mesh = run.mesh if rule is None else dataclasses.replace(
      run.mesh, rules={**run.mesh.rules, "kv_heads": rule})
  return dataclasses.replace(run, model=dataclasses.replace(run.model, num_kv_heads=kv_heads),
                             mesh=mesh)


def test_kv_heads_split_over_tensor_or_the_size_is_named():
  """2 key/value heads split over tensor=2 (the k/v projection `[layers, D, 2, H_kv, K]`); 1 is
  refused before anything compiles, naming the field and both fixes; with
  mesh.rules.kv_heads='' it is replicated."""
  from test_sharding import small_config  # pylint: disable=import-outside-toplevel
  config = small_config("dense", fsdp=4, tensor=2).with_vocab(512)  # (a tokenizer's size)
  config = with_kv_heads(config, 2)
  built = train_state.build(config, sharding.make_mesh(config.mesh), abstract=True)
  spec = built.state.params["blocks"]["mixer"]["kv"]["kernel"].sharding.spec
  assert spec == P(None, "fsdp", None, "tensor", None)
  config = with_kv_heads(config, 1)
  with pytest.raises(ConfigError, match=r"^model\.num_kv_heads=1 is not divisible by "
                     r"mesh\.tensor=2 \(mesh\.rules\.kv_heads='tensor' shards it\); make it a "
                     r"multiple of 2, or set mesh\.rules\.kv_heads='' to keep it replicated$"):
    config_check.validate(config)
  config = with_kv_heads(config, 1, rule="")
  config_check.validate(config)
  built = train_state.build(config, sharding.make_mesh(config.mesh), abstract=True)
  assert built.state.params["blocks"]["mixer"]["kv"]["kernel"].sharding.spec == P(
      None, "fsdp", None, None, None)


@pytest.mark.slow  # two short trainings on 8 fake devices, ~1 min
@pytest.mark.parametrize("name,kv_heads,mesh", [
    ("dense", 2, dict(fsdp=4, tensor=2)),     # key/value heads split with the query heads
    ("pi_attention", 1, dict(tensor=2, context=4)),  # one, whole on each device, in the ring
])
def test_sharded_training_with_grouped_heads_matches_one_device(name, kv_heads, mesh):
  from test_sharding import small_config, train_losses  # pylint: disable=import-outside-toplevel
  configs = [with_kv_heads(small_config(name, **mesh), kv_heads,
                          rule="tensor" if kv_heads % 2 == 0 else ""),
             with_kv_heads(small_config(name), kv_heads, rule="tensor" if kv_heads % 2 == 0 else "")]
  losses, reference = (train_losses(config) for config in configs)
  assert reference[-1] < reference[0]
  np.testing.assert_allclose(losses[:2], reference[:2], rtol=1e-5)
  np.testing.assert_allclose(losses, reference, rtol=1e-3)


# The models.

@pytest.mark.parametrize("name", fast_first(sorted(models.REGISTRY), keep=(
    sorted(models.REGISTRY).index("pi_attention"),)))
def test_every_family_takes_grouped_heads(name):
  """Every family's attention takes model.num_kv_heads: 4 query heads over 1 key/value head give
  fewer parameters (the k/v projections shrink), the same logits shape, and a causal model."""
  params = lambda cfg: sum(x.size for x in jax.tree.leaves(nnx.state(
      models.create(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
  cfg, grouped = tiny_model_config(name), tiny_model_config(name, num_kv_heads=1)
  D, K = cfg.d_model, cfg.d_model // cfg.num_heads
  assert params(cfg) - params(grouped) >= 2 * D * (cfg.num_heads - 1) * K
  model = models.create(grouped, rngs=nnx.Rngs(0))
  T = grouped.seq_len
  tokens = jax.random.randint(jax.random.key(1), (1, T), 0, grouped.vocab_size)
  x_BTD = model.embed_tokens(tokens)
  Tp = model(tokens).shape[1]
  graphdef, state = nnx.split(model)
  t = T - 3
  out = lambda x, state: jnp.sum(nnx.merge(graphdef, state).from_embeddings(x)[0, t - (T - Tp)])
  grad = jax.jit(jax.grad(out, argnums=(0, 1)))(x_BTD, state)[0]  # (nnx: the state's too)
  norms = np.linalg.norm(np.asarray(grad[0]), axis=-1)
  assert np.all(norms[t + 1:] == 0.0) and norms[t] > 0.0


def cache_bytes_per_row(cfg, max_len: int, batch_size: int = 2) -> dict[str, float]:
  """Bytes per batch row of a fresh decoding cache (shapes only): its keys and values, and all of
  it (with the slots' positions and document ids)."""
  model = nnx.eval_shape(lambda: models.create(cfg, rngs=nnx.Rngs(0)))
  cache = jax.eval_shape(lambda: model.init_cache(batch_size, max_len))
  leaves = jax.tree_util.tree_leaves_with_path(cache)
  size = lambda x: x.size * x.dtype.itemsize / batch_size
  kv = sum(size(x) for path, x in leaves if jax.tree_util.keystr(path).endswith(("['k']", "['v']")))
  return {"kv": kv, "all": sum(size(x) for _, x in leaves)}


def test_dense_multi_query_cache_is_one_num_heads_th():
  """dense at the default size (d_model 256, 4 layers, 4 heads) and 2,048 tokens: the decoding
  cache's keys and values per row are 16 MiB, with one key/value head 4 MiB (1 / num_heads)."""
  configs = [load_config("dense", preset) for preset in (None, "mqa")]
  for config in configs:
    config.data.update(vocab_size=512, seq_len=2048)
  default, mqa = (build(config).model for config in configs)
  assert (default.num_heads, default.num_kv_heads, mqa.num_kv_heads) == (4, 0, 1)
  default, mqa = cache_bytes_per_row(default, 2048), cache_bytes_per_row(mqa, 2048)
  assert default["kv"] == 4 * 2 * 2048 * 256 * 4 == 16 * 2 ** 20
  assert mqa["kv"] * 4 == default["kv"]
  assert mqa["all"] < default["all"] / 3.9  # positions and document ids are not per head


@pytest.mark.slow  # ~25 s: 20 steps, an evaluation, a checkpoint, a sample and an export
def test_dense_multi_query_trains_from_its_config_file(tiny_config, tmp_path):
  """`configs/dense.py:mqa` through the whole loop: the loss falls, the k/v projection has one
  head, the workdir's config.json says so, the sample decodes through the small cache, and the
  export holds the queries' and the keys/values' tensors apart, loading to the same logits."""
  config = tiny_config("dense", "mqa", num_steps=20, eval_every=20, checkpoint_every=20,
                       log_every=5, learning_rate=1e-2)
  assert config.model.num_kv_heads == 1
  workdir = str(tmp_path / "mqa")
  summary = train.train_and_evaluate(build(config), workdir)
  with open(f"{workdir}/metrics.jsonl", encoding="utf-8") as f:
    losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
  assert summary["step"] == 20 and losses[-1] < losses[0] - 0.3, losses
  with open(f"{workdir}/config.json", encoding="utf-8") as f:
    assert json.load(f)["model"]["num_kv_heads"] == 1
  m = build(config).model
  model = nnx.eval_shape(lambda: models.create(m, rngs=nnx.Rngs(0)))
  D, K = m.d_model, m.d_model // m.num_heads
  assert model.blocks.mixer.kv.kernel.shape == (m.num_layers, D, 2, 1, K)
  out = str(tmp_path / "export")
  export.export(workdir, out)
  tensors = load_file(f"{out}/model.safetensors")
  assert tensors["blocks.mixer.q.kernel"].shape == (m.num_layers, D, m.num_heads, K)
  assert tensors["blocks.mixer.kv.kernel"].shape == (m.num_layers, D, 2, 1, K)
  assert "blocks.mixer.qkv.kernel" not in tensors
  with open(f"{out}/README.md", encoding="utf-8") as f:
    assert f"{m.num_heads} heads (1 key/value heads)" in f.read()
  ids = np.arange(2 * m.seq_len).reshape(2, m.seq_len) % 50 + 3
  np.testing.assert_array_equal(efficient_lm.load(out).logits(ids),
                                efficient_lm.load(workdir).logits(ids))


def test_the_field_and_its_check():
  """0 (the default) means as many as num_heads; a value not dividing num_heads is one line naming
  the field and the divisors; a config written before the field loads with num_heads of them."""
  assert tiny_model_config("dense").kv_heads == 4
  assert tiny_model_config("dense", num_kv_heads=2).kv_heads == 2
  with pytest.raises(ConfigError, match=r"^model\.num_kv_heads=3 must divide model\.num_heads=4 "
                     r"\(grouped-query attention\); set model\.num_kv_heads to one of 1, 2, 4"):
    tiny_model_config("dense", num_kv_heads=3)
  with pytest.raises(ConfigError, match=r"^model\.num_kv_heads=-1 must be an integer >= 0"):
    tiny_model_config("dense", num_kv_heads=-1)
  saved = config_base.base_config("bcmt").to_dict()
  saved["model"].update(num_heads=8, d_model=64)
  del saved["model"]["num_kv_heads"]
  old = RunConfig.from_json(json.dumps(saved), families.CLASSES)  # an older config.json
  assert old.model.kv_heads == 8
