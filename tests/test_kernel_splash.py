"""The `splash` backend (TPU Pallas splash-attention kernels) against the `reference` backend.

On this CPU host the kernels run in Pallas interpret mode: values (o and lse) and every
gradient (q, k, v, local and skip priors) under cotangents on o and lse, for every pattern
kind at ragged lengths, with offsets, bfloat16, a traced q_start with a static k_offset (the
sequence-chunked blocks, chunk 0's halo at negative positions), the fallback to `xla`, and the
masks themselves, and per shard on a CPU mesh. One test compiles fwd + bwd for a real TPU target (libtpu's topology, no TPU
needed) on a 4-device mesh with the batch split, and checks no q / k / v is gathered.
"""
# pylint: disable=protected-access

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first
from jax.sharding import NamedSharding, PartitionSpec as P

from efficient_lm.ops import core
from efficient_lm.ops.core import backends, splash
from efficient_lm.ops.pattern import Pattern
from test_core import assert_matches, random_inputs, value_and_grads


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch, request):
  """Kernel tests must run the kernel: a call that fell back to `xla` fails."""
  if "fallback" in request.node.name:
    return

  def refuse(*args, **kwargs):
    raise AssertionError("this call fell back to the xla backend")

  from efficient_lm.ops.core import xla  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(xla, "BACKEND", dataclasses.replace(xla.BACKEND, attend=refuse))


def attend(impl, pattern, **kw):
  """`core.attend` on `impl` as a function of (q, k, v, local_prior, skip_prior)."""
  heads = kw.pop("layout", "BTHK") == "BHTK"
  swap = lambda x: None if x is None or not heads else jnp.swapaxes(x, 1, 2)

  def fn(q, k, v, lp, sp):
    if heads:
      q, k, v, lp, sp = (swap(x) for x in (q, k, v, lp, sp))
    o, lse = core.attend(q, k, v, pattern, local_prior=lp, skip_prior=sp, impl=impl,
                         interpret=impl == "splash", layout="BHTK" if heads else "BTHK", **kw)
    return (swap(o), swap(lse)) if heads else (o, lse)

  return fn


def assert_close(got, want, atol):
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=atol,
                               rtol=atol)


def check(pattern, Tq, Tk, *, q_start=0, k_start=0, priors=None, layout="BTHK", B=2, H=1, K=8,
          dtype=jnp.float32, atol=2e-5, seed=0):
  """splash against reference for one call: (o, lse) and the gradients of q, k, v and the priors
  under an o and an lse cotangent."""
  priors = priors or (True, pattern.has_skips)
  args, cotangents = random_inputs(Tq, Tk, B=B, H=H, K=K, seed=seed, dtype=dtype, priors=priors)
  kw = dict(q_start=q_start, k_start=k_start, layout=layout)
  run = lambda impl: jax.jit(lambda *a: value_and_grads(attend(impl, pattern, **kw), a,
                                                        cotangents))(*args)
  (o, lse), grads = run("splash")
  (ro, rlse), rgrads = run("reference")
  assert o.dtype == dtype and lse.dtype == jnp.float32
  assert_close((o, lse), (ro, rlse), atol)
  assert len(grads) == len(rgrads) == 3 + sum(priors)
  assert_close(grads, rgrads, 10 * atol)
  return o, lse


CASES = [
    # (pattern, Tq, Tk, q_start, k_start)
    (Pattern.dense(), 40, 40, 0, 0),
    (Pattern.dense(), 5, 5, 0, 0),
    (Pattern.sliding(5), 37, 37, 0, 0),       # a window narrower than T ...
    (Pattern.sliding(100), 20, 20, 0, 0),     # ... and wider
    (Pattern.blocks(8), 37, 37, 0, 0),        # chunked-causal blocks, ragged T
    (Pattern.blocks(8, 1), 37, 37, 0, 0),     # ECP's lookback 1
    (Pattern.blocks(5, 2), 30, 30, 0, 0),
    (Pattern.segments(5), 20, 20, 0, 0),      # bidirectional segments
    (Pattern.pi(4, 6, 3), 40, 40, 0, 0),
    (Pattern.pi(4, 64, 3), 24, 24, 0, 0),     # every skip past the start
    (Pattern.pi(3, 5, 4), 10, 25, 15, 5),     # skips before the keys' start
    (Pattern.dense(), 12, 30, 13, -3),        # keys at negative positions (static)
    (Pattern.blocks(4, 1), 12, 30, 13, 2),    # a chunk starting inside a block (phase 1)
    (Pattern.sliding(6), 9, 40, 20, 0),       # a chunk against the whole sequence
    (Pattern.dense(), 8, 8, 0, 16),           # every key in the future: no row sees one
]


@pytest.mark.parametrize("pattern,Tq,Tk,q_start,k_start", fast_first(CASES, keep=2), ids=lambda x: repr(x))
def test_matches_reference(pattern, Tq, Tk, q_start, k_start):
  o, lse = check(pattern, Tq, Tk, q_start=q_start, k_start=k_start, seed=Tq + q_start)
  if k_start >= q_start + Tq:
    np.testing.assert_array_equal(o, 0.0)
    np.testing.assert_array_equal(lse, np.float32(core.NO_KEY_LSE))


def test_heads_and_batch_heads_first_layout_and_head_width_64():
  check(Pattern.blocks(8, 1), 21, 21, layout="BHTK", H=2, seed=1)
  check(Pattern.sliding(7), 11, 11, B=1, K=64, seed=2)


@pytest.mark.parametrize("pattern", fast_first([Pattern.pi(4, 6, 3), Pattern.dense()]), ids=repr)
def test_bfloat16(pattern):
  """bf16 q, k, v: o and dq / dk / dv in bf16, lse and the priors' gradients float32."""
  check(pattern, 33, 33, dtype=jnp.bfloat16, atol=3e-2, seed=3)


@pytest.mark.parametrize("pattern", [Pattern.blocks(8, 1), Pattern.sliding(6), Pattern.pi(4, 5, 2)],
                         ids=repr)
def test_traced_chunks_with_a_halo(pattern):
  """Sequence chunking: one jitted call per chunk of 16 queries at a traced q_start (q_align =
  16, a multiple of the block) against its 8-key halo and itself (k_offset = -8); chunk 0's halo
  sits at negative positions. One compile serves every chunk; each matches the reference."""
  T, chunk, halo = 48, 16, 8
  args, (cot_o, cot_lse) = random_inputs(T + halo, T + halo, H=1, seed=4, priors=(True, True))
  q, k, v, lp, sp = args  # k, v: [halo zeros..., the sequence]
  k, v = (jnp.pad(x[:, :T], [(0, 0), (halo, 0), (0, 0), (0, 0)]) for x in (k, v))
  sp = sp if pattern.has_skips else None

  def run(impl):
    def one(q_c, k_c, v_c, lp_c, sp_c, start, cot_o, cot_lse):
      fn = lambda *a: attend(impl, pattern, q_start=start, k_offset=-halo, q_align=chunk)(*a)
      return value_and_grads(fn, (q_c, k_c, v_c, lp_c, sp_c), (cot_o, cot_lse))
    return jax.jit(one)

  splash_chunk, reference_chunk = run("splash"), run("reference")
  rows = lambda x, c: None if x is None else x[:, c * chunk:(c + 1) * chunk]
  for c in range(T // chunk):
    chunk_args = (rows(q, c), k[:, c * chunk:c * chunk + chunk + halo],
                  v[:, c * chunk:c * chunk + chunk + halo], rows(lp, c), rows(sp, c),
                  jnp.int32(c * chunk), rows(cot_o, c), rows(cot_lse, c))
    got, want = splash_chunk(*chunk_args), reference_chunk(*chunk_args)
    assert_close(got[0], want[0], 2e-5)
    assert_close(got[1], want[1], 2e-4)
  assert splash_chunk._cache_size() == 1


def call(pattern=Pattern.dense(), **kw):
  fields = dict(pattern=pattern, scale=1.0, Tq=16, Tk=24, q_start=None, k_start=None, k_offset=-8,
                q_align=16, explicit=False, local_prior=False, skip_prior=False, layout="BTHK",
                dtype="float32")
  return backends.Call(**{**fields, **kw})


def test_fallback_to_xla_names_the_reason():
  """Calls the kernel cannot express by their structure run on xla, with a one-line reason."""
  assert splash.unsupported(call()) is None
  assert splash.unsupported(call(pattern=Pattern.blocks(8, 1))) is None
  reasons = {
      "explicit": call(explicit=True),
      "traced key offset": call(k_offset=None),
      "q_align": call(pattern=Pattern.blocks(8), q_align=4),
      "float16": call(dtype="float16"),
  }
  assert splash.unsupported(call(Tk=70_000)) is None  # cut into pieces (below)
  for words, bad in reasons.items():
    reason = splash.unsupported(bad)
    assert reason is not None and words in reason and "\n" not in reason, (words, reason)
  # Explicit key positions (a decoding cache) run on xla and still match the reference.
  (q, k, v, _, _), _ = random_inputs(2, 6, seed=5)
  positions = jnp.asarray([4, 5, -1, 0, 1, 2], jnp.int32)
  run = lambda impl: jax.jit(lambda *a: core.attend(*a, Pattern.sliding(4), q_start=5,
                                                    k_positions=positions, impl=impl,
                                                    interpret=True))(q, k, v)
  assert_close(run("splash"), run("reference"), 2e-5)
  assert all(splash.pattern_unsupported(p) is None for p in
             (Pattern.dense(), Pattern.segments(4), Pattern.pi(3, 4, 2), Pattern(causal=False)))
  patterns = [Pattern.blocks(4, 1), Pattern.pi(3, 4, 2)]
  assert backends.check_patterns("splash", "tpu", patterns) is None


@pytest.mark.parametrize("pattern", [Pattern.dense(), Pattern.sliding(5), Pattern.blocks(4, 1),
                                     Pattern.segments(3), Pattern(causal=False)], ids=repr)
def test_mask_intervals_are_the_pattern(pattern):
  """Each query's key interval is `Pattern.local_visible` (numpy only, no kernel), and the block
  tables list exactly the blocks holding a visible pair."""
  for phase, k_offset, min_key in [(0, 0, 0), (3, -6, 2), (1, 5, 0)]:
    spec = splash._Spec(pattern=pattern, Tq=20, Tk=27, k_offset=k_offset, phase=phase,
                        min_key=min_key, bq=8, bkv=8, interpret=True)
    masks = splash._masks(spec)
    # Positions relative to a q_start of `phase`, shifted by whole blocks so that none is
    # negative (the keys' sign is `min_key`'s part).
    shift = 1000 * (pattern.block_size or 1)
    q_pos = shift + phase + np.arange(spec.Tq_pad)
    k_pos = shift + phase + k_offset + np.arange(spec.Tk_pad)
    i, j = np.arange(spec.Tq_pad)[:, None], np.arange(spec.Tk_pad)[None]
    want = np.asarray(pattern.local_visible(q_pos[:, None], k_pos[None])) & (j >= min_key) \
        & (j < spec.Tk) & (i < spec.Tq)
    got = (j >= masks.lo[:, None]) & (j < masks.hi[:, None])
    np.testing.assert_array_equal(got, want)
    blocks = want.reshape(spec.Tq_pad // 8, 8, spec.Tk_pad // 8, 8).any(axis=(1, 3))
    for (block_mask, data_next), lines in ((masks.fwd, blocks), (masks.dkv, blocks.T)):
      table, nexts = (block_mask[0], data_next[0]) if lines is blocks else (block_mask[0].T,
                                                                             data_next[0].T)
      listed = np.zeros_like(lines)
      for a in range(lines.shape[0]):
        listed[a, nexts[a][table[a] > 0]] = True
      np.testing.assert_array_equal(listed, lines)


def test_masks_of_a_long_chunk_build_in_seconds():
  """The masks of one sequence chunk with its halo (16K queries x 24K keys) at the kernel's
  smallest tile build in well under a second each: O(Tq * Tk / block) numpy."""
  for pattern in (Pattern.dense(), Pattern.blocks(2048, 1), Pattern.sliding(4096)):
    spec = splash._Spec(pattern=pattern, Tq=16384, Tk=24576, k_offset=-8192, phase=0, min_key=0,
                        bq=128, bkv=128, interpret=False)
    start = time.perf_counter()
    splash._masks(spec)
    assert time.perf_counter() - start < 5.0, pattern


def test_per_shard_on_a_cpu_mesh():
  """Under a mesh with the batch and the heads split (4 of the fake CPU devices), the kernel runs
  per shard (interpreted) and matches the unsharded reference in values and gradients."""
  mesh = jax.make_mesh((2, 1, 2, 1), ("data", "fsdp", "tensor", "context"),
                       devices=jax.devices()[:4])
  args, cotangents = random_inputs(24, 24, seed=6, priors=(True, True))
  pattern = Pattern.pi(4, 6, 2)
  run = lambda impl: jax.jit(lambda *a: value_and_grads(attend(impl, pattern), a, cotangents))
  with jax.set_mesh(mesh):
    spread = [jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor"))) for x in args]
    step = run("splash")
    got = step(*spread)
    assert "all-gather" not in step.lower(*spread).compile().as_text()
  want = run("reference")(*args)
  assert_close(jax.tree.leaves(got), jax.tree.leaves(want), 2e-5)


def tpu_mesh():
  """A 4-chip v5e mesh from libtpu's topology (no TPU needed), or skip."""
  try:
    from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
    topology = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    return topologies.make_mesh(topology, (1, 4, 1, 1), ("data", "fsdp", "tensor", "context"))
  except Exception as error:  # pylint: disable=broad-except
    pytest.skip(f"libtpu cannot give a TPU topology on this host ({type(error).__name__}: {error})")


def test_compiles_for_tpu_per_shard_without_gathering():
  """fwd + bwd of a π call compiled for a 4-chip TPU with the batch split over fsdp: Mosaic
  lowers the three kernels (forward, dkv, dq), and q / k / v are never all-gathered."""
  mesh = tpu_mesh()
  B, T, H, K = 4, 384, 2, 128
  qkv = jax.ShapeDtypeStruct((B, T, H, K), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("fsdp", None, None, None)))
  rows = jax.ShapeDtypeStruct((B, T, H), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
  pattern = Pattern.pi(64, 96, 2)

  def step(q, k, v, lp, sp):
    def loss(*a):
      o, lse = core.attend(*a[:3], pattern, local_prior=a[3], skip_prior=a[4], impl="splash")
      return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(lse)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, lp, sp)

  with jax.set_mesh(mesh):
    compiled = jax.jit(step).lower(qkv, qkv, qkv, rows, rows).compile()
  hlo = compiled.as_text()
  assert hlo.count('custom_call_target="tpu_custom_call"') == 3
  assert "all-gather" not in hlo
  local_q = B // 4 * T * H * K * 2
  assert compiled.memory_analysis().argument_size_in_bytes < 4 * local_q + 2 * B * T * H * 4


@pytest.mark.parametrize("pattern", fast_first([Pattern.dense(), Pattern.sliding(150),
                                                Pattern.blocks(128, 1)], keep=(0,)), ids=str)
def test_a_call_longer_than_one_kernel_call_is_cut_into_pieces(pattern, monkeypatch):
  """Past `MAX_KEYS` keys (here made 384) a call runs as one kernel call per pair of query and key
  pieces that sees a key, merged by log-sum-exp: the reference's values and gradients, with a
  ring step's backward (`core.attend_backward` at the call's own o and lse) too."""
  monkeypatch.setattr(splash, "MAX_KEYS", 384)
  monkeypatch.setattr(splash, "PIECE", 128)
  T = 300
  assert splash.pieces(T, 128) == [(0, 128), (128, 128), (256, 44)]
  args, cotangents = random_inputs(T, T, B=1, H=1, seed=21)
  calls = sum(backends.KERNEL_CALLS.values())
  assert_matches(attend("splash", pattern), attend("reference", pattern), args, cotangents)
  seen = sum(backends.KERNEL_CALLS.values()) - calls
  assert 3 <= seen < 2 * 9  # a causal pair above the diagonal is never called
  q, k, v = args[:3]
  o, lse = core.attend(q, k, v, pattern, impl="reference")
  do = cotangents[0].astype(q.dtype)
  got = core.attend_backward(q, k, v, pattern, o, lse, do, cotangents[1], impl="splash",
                             interpret=True)
  want = core.attend_backward(q, k, v, pattern, o, lse, do, cotangents[1])
  for g, w in zip(got[:3], want[:3]):
    np.testing.assert_allclose(g, w, atol=2e-4)


def test_tiles_follow_the_pattern():
  assert [splash.tile(p) for p in (Pattern.dense(), Pattern.sliding(128), Pattern.sliding(129),
                                   Pattern.blocks(256), Pattern.pi(64, 512, 4), Pattern.sliding(8))
          ] == [512, 128, 256, 256, 128, 128]


def test_pi_wide_window_masks_list_only_the_window_blocks(monkeypatch):
  """π through the front door: the kernel's block tables come from the local pattern alone (the
  skips run beside it as slices), so a query block visits its window's key blocks, never the
  blocks back to its farthest skip (window 100, period 256, 3 skips: 128-tiles, 8 blocks)."""
  specs = []
  real = splash._masks
  monkeypatch.setattr(splash, "_masks", lambda spec: specs.append(spec) or real(spec))
  pattern, T = Pattern.pi(100, 256, 3), 1024
  x = jax.ShapeDtypeStruct((1, T, 2, 8), jnp.float32)
  jax.eval_shape(lambda q, k, v: core.attend(q, k, v, pattern, impl="splash", interpret=True),
                 x, x, x)
  assert specs and all(spec.pattern == pattern.local for spec in specs)
  spec = specs[-1]
  block_mask, data_next = splash._masks(spec).fwd
  visible = np.asarray(pattern.local_visible(np.arange(T)[:, None], np.arange(T)[None]))
  n = T // spec.bq
  want = visible.reshape(n, spec.bq, n, spec.bkv).any(axis=(1, 3))
  for a in range(n):
    visits = set(data_next[0][a][block_mask[0][a] > 0].tolist())
    assert visits == set(np.nonzero(want[a])[0].tolist()), (a, visits)
    assert visits <= {a - 1, a}  # the skips' blocks (a - 2, a - 4, a - 6) are not visited
