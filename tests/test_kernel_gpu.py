"""The `gpu` attention backend (`ops/core/gpu.py`) against the `reference` backend.

On this CPU host the Pallas kernels run in interpret mode (`interpret=True`), with the tiles
shrunk so that every call spans several query and key blocks (ragged ends, skipped blocks):
values and every gradient (q, k, v, priors) under cotangents on o and lse, for each pattern
kind, bfloat16, both layouts, a traced q_start with a static k_offset (sequence chunks, keys
at negative positions), per shard on a mesh, and the xla fallback. The cuDNN path cannot be
interpreted: it is checked by compiling for an H200 from this host (a subprocess with the CUDA
plugin), with the Pallas kernels' Triton calls.
"""

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first

from efficient_lm.ops import core
from efficient_lm.ops.core import backends, gpu
from efficient_lm.ops.pattern import Pattern
from efficient_lm.parallel import targets
from tests.test_targets import HAS_CUDNN

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_PLUGIN = os.environ.get("EFFICIENT_LM_CUDA_PLUGIN", "")  # a folder holding the plugin


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
  """16 x 32 tiles: a T of 37 is 3 query blocks and 2 key blocks, both ragged."""
  monkeypatch.setattr(gpu, "BLOCK_Q", 16)
  monkeypatch.setattr(gpu, "BLOCK_K", 32)


def inputs(Tq, Tk, *, B=2, H=2, K=16, seed=0, dtype=jnp.float32, priors=(False, False),
           layout="BTHK"):
  keys = jax.random.split(jax.random.key(seed), 7)
  shape = (lambda T, k: (B, T, H, k)) if layout == "BTHK" else (lambda T, k: (B, H, T, k))
  rows = (B, Tq, H) if layout == "BTHK" else (B, H, Tq)
  q, k, v = (jax.random.normal(kk, shape(T, K), jnp.float32).astype(dtype)
             for kk, T in zip(keys[:3], (Tq, Tk, Tk)))
  lp = jax.random.normal(keys[3], rows) if priors[0] else None
  sp = jax.random.normal(keys[4], rows) if priors[1] else None
  cotangents = jax.random.normal(keys[5], shape(Tq, K)), jax.random.normal(keys[6], rows)
  return (q, k, v, lp, sp), cotangents


def values_and_grads(fn, args, cotangents):
  """(o, lse) and the gradients of <o, cot_o> + <lse, cot_lse> (rows that see a key) in q, k, v
  and the given priors."""
  cot_o, cot_lse = cotangents

  def loss(*a):
    o, lse = fn(*a)
    seen = jnp.where(lse > core.NO_KEY_LSE / 2, lse, 0.0)
    return jnp.sum(o.astype(jnp.float32) * cot_o) + jnp.sum(seen * cot_lse), (o, lse)

  argnums = tuple(i for i, a in enumerate(args) if a is not None)
  (_, out), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(*args)
  return out, grads


def check(pattern, Tq, Tk=None, *, q_start=0, k_offset=0, traced=False, q_align=1, priors=None,
          dtype=jnp.float32, layout="BTHK", K=16, seed=0, atol=2e-5, grad_atol=None):
  """The gpu backend (interpreted) against `reference` on one call: o, lse and every gradient.
  `traced`: q_start is an argument of the jitted function (k_offset stays static)."""
  Tk = Tq if Tk is None else Tk
  priors = priors or (pattern.has_skips,) * 2
  args, cotangents = inputs(Tq, Tk, K=K, seed=seed, dtype=dtype, priors=priors, layout=layout)

  def run(impl, start):
    def fn(q, k, v, lp, sp):
      return core.attend(q, k, v, pattern, q_start=start, k_offset=k_offset, q_align=q_align,
                         local_prior=lp, skip_prior=sp, layout=layout, impl=impl,
                         interpret=impl == "gpu")
    return fn

  if traced:
    got = jax.jit(lambda start, *a: values_and_grads(run("gpu", start), a, cotangents))(
        jnp.int32(q_start), *args)
  else:
    got = jax.jit(lambda *a: values_and_grads(run("gpu", q_start), a, cotangents))(*args)
  up = lambda x: None if x is None else x.astype(jnp.float32)  # the reference in float32
  want = jax.jit(lambda *a: values_and_grads(run("reference", q_start), a, cotangents))(
      *map(up, args))
  (o, lse), grads = got
  (ro, rlse), rgrads = want
  assert o.dtype == dtype and lse.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(o, np.float32), ro, atol=atol, rtol=atol)
  np.testing.assert_allclose(lse, rlse, atol=atol, rtol=atol)
  assert len(grads) == 3 + sum(priors)
  grad_atol = 10 * atol if grad_atol is None else grad_atol
  for g, rg in zip(grads, rgrads):
    assert g.dtype == (dtype if g.ndim == 4 else jnp.float32)
    np.testing.assert_allclose(np.asarray(g, np.float32), rg, atol=grad_atol, rtol=grad_atol)
  return o, lse


# Every local pattern kind through the kernel, self-attention at ragged lengths.

SELF_CASES = [
    (Pattern.dense(), 37), (Pattern.dense(), 5),
    (Pattern.sliding(5), 37), (Pattern.sliding(100), 20),  # windows narrower and wider than T
    (Pattern.blocks(8), 37), (Pattern.blocks(8, 1), 37), (Pattern.blocks(5, 1), 23),
    (Pattern.segments(5), 20),  # bidirectional inside segments
]


@pytest.mark.parametrize("pattern,T", fast_first(SELF_CASES, keep=(2, 5)), ids=lambda x: repr(x))
def test_local_patterns_match_reference(pattern, T):
  check(pattern, T, seed=T)


@pytest.mark.slow  # 10-16 s in interpret mode
def test_offsets_priors_layout_and_head_width():
  """Cross-attention offsets, a local prior (lse moves, o does not), heads-first, K = 48 (padded
  to 64 inside the kernel), tiles the other way round."""
  check(Pattern.dense(), 12, 40, q_start=28, k_offset=-28, seed=1)  # the last 12 of 40 keys
  check(Pattern.sliding(6), 30, priors=(True, False), seed=2)
  check(Pattern.blocks(4, 1), 12, 30, q_start=13, k_offset=-11, layout="BHTK", K=48, seed=3)
  check(Pattern.dense(), 8, 8, q_start=0, k_offset=16, seed=4)  # every key in the future


@pytest.mark.slow  # 10-16 s in interpret mode
def test_pi_skips_beside_the_kernel():
  """π: the window in the kernel, the skips (reaching before the start, and past T) beside it,
  with both priors."""
  check(Pattern.pi(4, 6, 4), 40, seed=5)
  check(Pattern.pi(3, 7, 5), 40, seed=6)
  check(Pattern.pi(3, 5, 4), 10, 25, q_start=15, k_offset=-10, seed=8)  # skips before the keys


@pytest.mark.parametrize("pattern,T", fast_first([(Pattern.pi(4, 6, 4), 40), (Pattern.dense(), 40),
                                                  (Pattern.blocks(8, 1), 37)]), ids=lambda x: repr(x))
def test_bfloat16(pattern, T):
  """bf16 q, k, v: o and its gradients in bf16, lse float32, close to the float32 reference."""
  check(pattern, T, dtype=jnp.bfloat16, atol=3e-2, grad_atol=0.1, seed=9)


@pytest.mark.parametrize("pattern,Tq,Tk,q_start,k_offset,q_align", fast_first([
    (Pattern.blocks(8, 1), 16, 24, 16, -8, 8), (Pattern.blocks(8, 1), 16, 24, 0, -8, 8),
    (Pattern.sliding(6), 8, 14, 0, -6, 1)]), ids=lambda x: repr(x))
def test_traced_start_with_static_offset(pattern, Tq, Tk, q_start, k_offset, q_align):
  """Sequence chunks: Tq queries at a traced q_start (a multiple of q_align) against their keys
  from |k_offset| back (ECP's blocks: one block). Chunk 0's halo sits at negative positions:
  unseen."""
  check(pattern, Tq, Tk, q_start=q_start, k_offset=k_offset, traced=True, q_align=q_align,
        seed=10 + q_start)


def test_per_shard_on_a_mesh():
  """Batch over `data`, heads over `tensor`: each device runs the kernel on its own rows."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 (fake) devices")
  mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:4])
  (q, k, v, lp, _), _ = inputs(24, 24, seed=12, priors=(True, False))
  pattern = Pattern.sliding(7)
  fn = lambda impl: jax.jit(lambda q, k, v, lp: core.attend(
      q, k, v, pattern, local_prior=lp, impl=impl, interpret=impl == "gpu"))
  want = fn("reference")(q, k, v, lp)
  with jax.set_mesh(mesh):
    spec = jax.sharding.PartitionSpec("data", None, "tensor")
    put = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    got = fn("gpu")(*(put(x) for x in (q, k, v, lp)))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)


# Which part serves which call.

def call_of(pattern, *, T=64, q_start=0, k_offset=0, explicit=False, priors=(False, False),
            dtype="bfloat16", with_lse=False, layout="BTHK"):
  return backends.Call(pattern=pattern, scale=0.125, Tq=T, Tk=T, q_start=q_start,
                       k_start=None if q_start is None or k_offset is None else q_start + k_offset,
                       k_offset=k_offset, q_align=1, explicit=explicit, local_prior=priors[0],
                       skip_prior=priors[1], layout=layout, dtype=dtype, with_lse=with_lse)


def test_cudnn_takes_causal_and_window_self_attention_without_lse():
  x = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  takes = lambda call, interpret=False, width=64: gpu._takes_cudnn(call, x[..., :width],
                                                                  x[..., :width], interpret)
  assert takes(call_of(Pattern.dense())) and takes(call_of(Pattern.sliding(16)))
  assert takes(call_of(Pattern.dense(), q_start=32))
  for reason, call in [
      ("lse wanted", call_of(Pattern.dense(), with_lse=True)),
      ("a prior", call_of(Pattern.sliding(8), priors=(True, False))),
      ("blocks", call_of(Pattern.blocks(16, 1))), ("segments", call_of(Pattern.segments(16))),
      ("skips", call_of(Pattern.pi(8, 16, 2))), ("float32", call_of(Pattern.dense(), dtype="float32")),
      ("a key offset", call_of(Pattern.dense(), k_offset=-8)),
      ("a traced start", call_of(Pattern.dense(), q_start=None))]:
    assert not takes(call), reason
  assert not takes(call_of(Pattern.dense()), interpret=True)  # cuDNN cannot be interpreted
  assert not takes(call_of(Pattern.dense()), width=12)  # not a multiple of 8


@pytest.mark.parametrize("error", [NotImplementedError("cuDNN refuses this call"),
                                   RuntimeError("cuDNN not found.")], ids=["refusal", "no_cudnn"])
def test_a_cudnn_refusal_runs_the_kernel(monkeypatch, error):
  """jax's cuDNN checks refuse while the call traces (NotImplementedError), or a CUDA plugin has no
  cuDNN library beside it (jax: 'cuDNN not found.', where compiling used to stop): the kernel
  runs. Any other error still raises."""
  def raising(exception):
    def fail(*args):
      raise exception
    return fail
  monkeypatch.setattr(gpu, "_takes_cudnn", lambda *args: True)
  monkeypatch.setattr(gpu, "_cudnn_attend", raising(error))
  (q, k, v, _, _), _ = inputs(20, 20, seed=15)
  call = call_of(Pattern.sliding(5), T=20, dtype="float32")
  o, lse = gpu.attend(call, q, k, v, 0, 0, None, None, None, None, None, interpret=True)
  want = core.attend(q, k, v, Pattern.sliding(5), scale=0.125, impl="reference")
  np.testing.assert_allclose(o, want[0], atol=2e-5)
  np.testing.assert_allclose(lse, want[1], atol=2e-5)
  monkeypatch.setattr(gpu, "_cudnn_attend", raising(RuntimeError("something else")))
  with pytest.raises(RuntimeError, match="something else"):
    gpu.attend(call, q, k, v, 0, 0, None, None, None, None, None, interpret=True)


def test_fallbacks_to_xla_are_named():
  assert "explicit key positions" in gpu.unsupported(call_of(Pattern.dense(), explicit=True))
  assert "traced key offset" in gpu.unsupported(call_of(Pattern.dense(), q_start=None, k_offset=None))
  assert gpu.unsupported(call_of(Pattern.blocks(8, 1), q_start=None, k_offset=-8)) is None
  assert all(gpu.pattern_unsupported(p) is None for p in
             (Pattern.dense(), Pattern.segments(4), Pattern.pi(3, 4, 3), Pattern(causal=False)))
  backend = backends.get("gpu")
  assert backend.platforms == ("gpu",) and backend.attend is gpu.attend
  assert "need a GPU" in backends.check("gpu", "cpu", interpret=False)
  # A decoding cache's explicit slot positions: the call runs on xla, and matches.
  pattern, positions = Pattern.sliding(4), jnp.asarray([4, 5, 6, 3, -1], jnp.int32)
  (q, k, v, _, _), _ = inputs(2, 5, seed=13)
  got = core.attend(q, k, v, pattern, q_start=6, k_positions=positions, impl="gpu",
                    interpret=True)
  want = core.attend(q, k, v, pattern, q_start=6, k_positions=positions, impl="reference")
  np.testing.assert_allclose(got[0], want[0], atol=2e-5)
  np.testing.assert_allclose(got[1], want[1], atol=2e-5)
  assert any(name == "gpu" and "explicit" in why for name, why in core.FALLBACKS)
  # A ring step's traced key offset: xla too.
  (q, k, v, _, _), _ = inputs(8, 12, seed=14)
  step = lambda impl: jax.jit(lambda qs, ks: core.attend(q, k, v, Pattern.sliding(6), q_start=qs,
                                                         k_start=ks, impl=impl, interpret=True))
  for g, w in zip(step("gpu")(10, 4), step("reference")(10, 4)):
    np.testing.assert_allclose(g, w, atol=2e-5)


@pytest.mark.parametrize("pattern", [Pattern.dense(), Pattern.sliding(5), Pattern.blocks(8, 1),
                                     Pattern.segments(8), Pattern(causal=False, window=6)], ids=repr)
@pytest.mark.parametrize("q_start,k_offset", [(0, 0), (13, -11), (0, -8), (20, 4)])
def test_block_ranges_cover_every_visible_pair(pattern, q_start, k_offset):
  """The forward's key blocks per query block and the backward's query blocks per key block
  hold every (query, key) pair the pattern shows, and windows skip blocks."""
  kern = gpu._Kernel(pattern=pattern, scale=1.0, Tq=37, Tk=45, k_offset=k_offset, layout="BTHK",
                     block_q=8, block_k=16, interpret=True)
  q_pos, k_pos = q_start + np.arange(37), q_start + k_offset + np.arange(45)
  seen = np.asarray(pattern.local_visible(q_pos[:, None], k_pos[None, :]))
  key_blocks = [range(*map(int, gpu._key_blocks(kern, q_start, i))) for i in range(5)]
  query_blocks = [range(*map(int, gpu._query_blocks(kern, q_start, j))) for j in range(3)]
  for a, b in zip(*np.nonzero(seen)):
    assert b // 16 in key_blocks[a // 8] and a // 8 in query_blocks[b // 16], (a, b)
  if pattern.window == 5:
    assert sum(len(r) for r in key_blocks) < 5 * 3


def test_target_capability_from_the_device_kind():
  """(jax's cuDNN checks answering for it: tests/test_jax_compat.py)"""
  assert gpu.target_capability() is None  # this host: no GPU, no GPU mesh
  for kind, capability in [("NVIDIA H100 80GB HBM3", (9, 0)), ("NVIDIA A100-SXM4-40GB", (8, 0)),
                           ("NVIDIA H20", (9, 0)), ("NVIDIA GeForce GTX 480", None)]:
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("data",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):  # a target known only by its kind
      assert gpu.target_capability() == capability, kind


# Compiling for a GPU from this host.

COMPILE_SCRIPT = textwrap.dedent('''
    import sys
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    from efficient_lm.ops import core
    from efficient_lm.ops.core import gpu
    from efficient_lm.ops.pattern import Pattern

    topology = topologies.get_topology_desc(platform="cuda", target_config=sys.stdin.read(),
                                            topology="1x1x1")
    mesh = jax.sharding.Mesh(topology.devices, ("data",))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def hlo(fn, *shapes):
      args = [jax.ShapeDtypeStruct(s, d, sharding=whole) for s, d in shapes]
      with jax.set_mesh(mesh):
        return jax.jit(fn).lower(*args).compile().as_text()

    def train_step(pattern, remat=False, **kw):  # fwd + bwd; lse in the loss when it is wanted
      def loss(q, k, v, start):
        attend = lambda q, k, v: core.attend(q, k, v, pattern, q_start=start, impl="gpu", **kw)
        o, lse = (jax.checkpoint(attend) if remat else attend)(q, k, v)
        return o.astype(jnp.float32).sum() + (0.0 if lse is None else lse.sum())
      return jax.grad(loss, argnums=(0, 1, 2))

    with jax.set_mesh(mesh):  # the compile-only device tells its capability
      print("capability", ".".join(map(str, gpu.target_capability())))
    bf16, i32 = jnp.bfloat16, jnp.int32
    qkv = lambda T, K, dtype=bf16: [((2, T, 2, K), dtype)] * 3
    checks = {
        # cuDNN: causal and a window, no lse; head width 256 (Hopper) under remat, whose
        # forward rule is traced after attend returned.
        "cudnn-causal": hlo(lambda q, k, v: train_step(Pattern.dense(), with_lse=False)(q, k, v, 0),
                            *qkv(128, 64)),
        "cudnn-window-256": hlo(lambda q, k, v: train_step(Pattern.sliding(32), remat=True,
                                                           with_lse=False)(q, k, v, 0),
                                *qkv(128, 256)),
        # The Pallas kernel: a window with lse; ECP blocks at a traced start with a static offset.
        "pallas-window-lse": hlo(lambda q, k, v: train_step(Pattern.sliding(16))(q, k, v, 0),
                                 *qkv(80, 64)),
        "pallas-blocks-traced": hlo(train_step(Pattern.blocks(16, 1), k_offset=-16, q_align=16),
                                    *qkv(48, 48, jnp.float32), ((), i32)),
        # Grouped-query attention: 4 query heads over 2 key/value heads (cuDNN's own grouping;
        # the kernel's k / v index map and its per-group dk / dv kernel).
        "cudnn-gqa": hlo(lambda q, k, v: train_step(Pattern.dense(), with_lse=False)(q, k, v, 0),
                         ((2, 128, 4, 64), bf16), *[((2, 128, 2, 64), bf16)] * 2),
        "pallas-gqa-window-lse": hlo(lambda q, k, v: train_step(Pattern.sliding(16))(q, k, v, 0),
                                     ((2, 80, 4, 64), bf16), *[((2, 80, 2, 64), bf16)] * 2),
    }
    for name, text in checks.items():
      cudnn = "__cudnn$fmha" in text
      triton = "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text
      print(name, "cudnn" if cudnn else "-", "triton" if triton else "-",
            text.count("gpu_attention_"))
''')


def test_compiles_for_an_h200_from_this_host():
  """The package's H200 description (`targets/gpu/h200.txtpb`) through the CUDA plugin."""
  names = ("jax_cuda12_plugin", "jax_cuda13_plugin")  # CUDA 12 or 13
  present = any(importlib.util.find_spec(n) is not None or bool(
      CUDA_PLUGIN and importlib.machinery.PathFinder.find_spec(n, [CUDA_PLUGIN])) for n in names)
  if not present:
    pytest.skip("the CUDA plugin is not installed: pip install -e '.[gpu]' (or point "
                "$EFFICIENT_LM_CUDA_PLUGIN at a folder holding it)")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([p for p in (CUDA_PLUGIN, REPO) if p]),
             JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
  done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT],
                        input=targets.gpu_description("h200"), env=env, cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-4000:]
  lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.strip())
  assert lines["capability"] == "9.0", lines
  # On cuDNN where its library is installed (jax[cuda12] brings it); a bare plugin: the kernel.
  for name in ("cudnn-causal", "cudnn-window-256", "cudnn-gqa"):
    assert lines[name].startswith("cudnn - " if HAS_CUDNN else "- triton "), lines
  for name in ("pallas-window-lse", "pallas-blocks-traced", "pallas-gqa-window-lse"):
    assert lines[name].startswith("- triton "), lines
    assert int(lines[name].split()[-1]) >= 3, lines  # forward, dq and dk / dv kernels


def test_pi_wide_window_kernel_visits_only_the_window_blocks(monkeypatch):
  """π through the front door: the kernel's key-block range per query block comes from the local
  pattern alone (the skips run beside it as slices): window 40, period 64, 3 skips on 16 x 32
  tiles visits at most 3 key blocks per query block, never the blocks back to its farthest skip."""
  kernels = []
  real = gpu._kernel_for
  monkeypatch.setattr(gpu, "_kernel_for", lambda *a: kernels.append(real(*a)) or kernels[-1])
  pattern, T = Pattern.pi(40, 64, 3), 256
  x = jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32)
  jax.eval_shape(lambda q, k, v: core.attend(q, k, v, pattern, impl="gpu", interpret=True), x, x, x)
  assert kernels and all(kern.pattern == pattern.local for kern in kernels)
  kern = kernels[-1]
  visible = np.asarray(pattern.local_visible(np.arange(T)[:, None], np.arange(T)[None]))
  for i in range(T // kern.block_q):
    start, stop = (int(b) for b in gpu._key_blocks(kern, 0, i))
    rows = visible[i * kern.block_q:(i + 1) * kern.block_q]
    want = [j for j in range(T // kern.block_k) if rows[:, j * kern.block_k:(j + 1) * kern.block_k].any()]
    assert list(range(start, stop)) == want, (i, start, stop, want)
