"""The attention core (`ops.core.attend`, `merge`) and `ops.pattern.Pattern` against plain references.

The reference builds the full `[Tq, Tk]` masks from the pattern's definition,
one position pair at a time, and runs a dense masked softmax in float32. The
core must agree in values (o and lse) and in every gradient (q, k, v, both
priors) of a readout that also puts a cotangent on lse, for every pattern
kind, at ragged lengths, with offsets (static and traced), explicit key
positions with empty slots, both layouts, and with the block sizes shrunk so
that every loop of both schedules runs several times.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first
from efficient_lm.ops import attention
from efficient_lm.ops import core
from efficient_lm.ops import priors
from efficient_lm.ops.core import backends
from efficient_lm.ops.pattern import Pattern
from efficient_lm.runtime import jax_compat


# The reference.

def reference_masks(pattern: Pattern, q_pos, k_pos) -> tuple[np.ndarray, np.ndarray]:
  """(local, skip) `[Tq, Tk]` bool from the definition, one pair at a time."""
  q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
  local = np.zeros((len(q_pos), len(k_pos)), bool)
  skip = np.zeros_like(local)
  for a, p in enumerate(q_pos):
    for b, j in enumerate(k_pos):
      if j < 0:
        continue
      ok = not (pattern.causal and j > p)
      ok &= pattern.window is None or j > p - pattern.window
      if pattern.block_size is not None:
        ok &= p // pattern.block_size - pattern.lookback <= j // pattern.block_size <= p // pattern.block_size
      local[a, b] = ok
      d, P = p - j, pattern.period  # π's stride: every P-th key, skip_from..skip_to periods back
      skip[a, b] = (not ok and P is not None and d > 0 and d % P == 0 and d // P >= pattern.skip_from
                    and (pattern.skip_to is None or d // P <= pattern.skip_to))
  return local, skip


def reference_attend(q, k, v, local, skip, lp=None, sp=None, scale=None):
  """Dense masked softmax on `[B, T, H, K]` arrays: (o, lse), empty rows o = 0, lse = NO_KEY_LSE."""
  f32 = lambda x: x.astype(jnp.float32)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  s = jnp.einsum("bqhk,bshk->bhqs", f32(q), f32(k)) * scale
  zero = jnp.zeros(q.shape[:3], jnp.float32)
  bias = lambda p: jnp.swapaxes(zero if p is None else p, 1, 2)[..., None]
  local, skip = jnp.asarray(local), jnp.asarray(skip)
  s = jnp.where(local, s + bias(lp), jnp.where(skip, s + bias(sp), -jnp.inf))
  seen = local | skip
  m = jnp.max(jnp.where(seen, s, -1e30), axis=-1, keepdims=True)
  p = jnp.where(seen, jnp.exp(s - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bhqs,bshk->bqhk", p / jnp.where(l > 0, l, 1.0), f32(v))
  lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)),
                  core.NO_KEY_LSE)
  return o.astype(q.dtype), jnp.swapaxes(lse, 1, 2)


def random_inputs(Tq, Tk, *, B=2, H=2, K=8, seed=0, dtype=jnp.float32, priors=(False, False)):
  keys = jax.random.split(jax.random.key(seed), 7)
  q, k, v = (jax.random.normal(kk, (B, T, H, K), jnp.float32).astype(dtype)
             for kk, T in zip(keys[:3], (Tq, Tk, Tk)))
  lp = jax.random.normal(keys[3], (B, Tq, H)) if priors[0] else None
  sp = jax.random.normal(keys[4], (B, Tq, H)) if priors[1] else None
  cot_o = jax.random.normal(keys[5], (B, Tq, H, K))
  cot_lse = jax.random.normal(keys[6], (B, Tq, H))
  return (q, k, v, lp, sp), (cot_o, cot_lse)


def value_and_grads(fn, args, cotangents):
  """(o, lse) and the gradients of <o, cot_o> + <lse, cot_lse> (rows that see a key) for q, k, v
  and the given priors."""
  cot_o, cot_lse = cotangents

  def loss(*a):
    o, lse = fn(*a)
    readout = jnp.sum(o.astype(jnp.float32) * cot_o)
    return readout + jnp.sum(jnp.where(lse > core.NO_KEY_LSE / 2, lse, 0.0) * cot_lse), (o, lse)

  argnums = tuple(i for i, a in enumerate(args) if a is not None)
  (_, out), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(*args)
  return out, grads


def assert_matches(fast, slow, args, cotangents, atol=2e-5):
  (o, lse), grads = jax.jit(lambda *a: value_and_grads(fast, a, cotangents))(*args)
  (ro, rlse), rgrads = jax.jit(lambda *a: value_and_grads(slow, a, cotangents))(*args)
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(ro, np.float32), atol=atol,
                             rtol=atol)
  np.testing.assert_allclose(lse, rlse, atol=atol, rtol=atol)
  for g, rg in zip(grads, rgrads):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(rg, np.float32),
                               atol=10 * atol, rtol=10 * atol)
  return o, lse


# The fast tier runs the tiny block sizes (every loop several times); the whole suite both.
@pytest.fixture(params=[pytest.param("default", marks=pytest.mark.slow), "tiny"])
def block_sizes(request, monkeypatch):
  """The tuned block sizes, and tiny ones under which every loop runs several times."""
  if request.param == "tiny":
    monkeypatch.setattr(core.plan, "Q_BLOCK", 8)
    monkeypatch.setattr(core.plan, "K_BLOCK", 4)
    monkeypatch.setattr(core.plan, "GROUP_TOKENS", 8)
    monkeypatch.setattr(core.plan, "SINGLE_BLOCK", 16)
  return request.param


def check(pattern, Tq, Tk, *, q_start=0, k_start=0, traced=False, k_positions=None, priors=None,
          seed=0, scale=None, layout="BTHK", atol=2e-5):
  """The core against the reference for one call: values, and gradients of q, k, v and the priors
  under an o and an lse cotangent. `traced`: the starts are arguments of the jitted function."""
  priors = priors or (pattern.has_skips, pattern.has_skips)
  args, cotangents = random_inputs(Tq, Tk, seed=seed, priors=priors)
  q_pos = q_start + np.arange(Tq)
  k_pos = k_start + np.arange(Tk) if k_positions is None else np.asarray(k_positions)
  local, skip = reference_masks(pattern, q_pos, k_pos)
  kpos = None if k_positions is None else jnp.asarray(k_positions, jnp.int32)

  def fast(q, k, v, lp, sp, qs, ks):
    if layout == "BTHK":
      return core.attend(q, k, v, pattern, q_start=qs, k_start=ks, k_positions=kpos, scale=scale,
                         local_prior=lp, skip_prior=sp)
    heads = lambda x: None if x is None else jnp.swapaxes(x, 1, 2)
    o, lse = core.attend(heads(q), heads(k), heads(v), pattern, q_start=qs, k_start=ks,
                         k_positions=kpos, scale=scale, local_prior=heads(lp), skip_prior=heads(sp),
                         layout="BHTK")
    return heads(o), heads(lse)

  if traced:
    got = jax.jit(lambda q, k, v, lp, sp, qs, ks: value_and_grads(
        lambda *a: fast(*a, qs, ks), (q, k, v, lp, sp), cotangents))(
            *args, jnp.int32(q_start), jnp.int32(k_start))
  else:
    got = jax.jit(lambda *a: value_and_grads(lambda *b: fast(*b, q_start, k_start), a,
                                             cotangents))(*args)
  want = jax.jit(lambda *a: value_and_grads(
      lambda q, k, v, lp, sp: reference_attend(q, k, v, local, skip, lp, sp, scale=scale), a,
      cotangents))(*args)
  (o, lse), grads = got
  (ro, rlse), rgrads = want
  np.testing.assert_allclose(o, ro, atol=atol, rtol=atol)
  np.testing.assert_allclose(lse, rlse, atol=atol, rtol=atol)
  assert len(grads) == len(rgrads) == 3 + sum(priors)
  for g, rg in zip(grads, rgrads):
    np.testing.assert_allclose(g, rg, atol=10 * atol, rtol=10 * atol)
  return o, lse


# Every pattern kind, self-attention from position 0.

SELF_CASES = [
    (Pattern.dense(), 40), (Pattern.dense(), 1), (Pattern.dense(), 37),
    (Pattern.sliding(1), 9), (Pattern.sliding(5), 37), (Pattern.sliding(16), 40),
    (Pattern.sliding(40), 40), (Pattern.sliding(100), 20),  # windows below, at and above T
    (Pattern.blocks(4), 37), (Pattern.blocks(8, 1), 37), (Pattern.blocks(5, 2), 37),
    (Pattern.blocks(64, 1), 5), (Pattern.blocks(1, 3), 13),  # a block above T; one-token blocks
    (Pattern.segments(5), 20), (Pattern.segments(20), 20), (Pattern.segments(3), 12),
    (Pattern.pi(8, 8, 3), 40), (Pattern.pi(3, 7, 5), 40), (Pattern.pi(5, 2, 6), 40),  # P < W
    (Pattern.pi(4, 64, 3), 24), (Pattern.pi(50, 4, 20), 24),  # skips past T; window past T
]


# The fast tier: one of each kind (and a window and skips past T).
@pytest.mark.parametrize("pattern,T", fast_first(SELF_CASES, keep=(0, 4, 9, 13, 16, 19)),
                         ids=lambda x: repr(x))
def test_self_attention_matches_reference(pattern, T, block_sizes):
  check(pattern, T, T, seed=T)


# Offsets: queries and keys at other positions (cross-attention, ring steps, chunks).

OFFSET_CASES = [
    # (pattern, Tq, Tk, q_start, k_start)
    (Pattern.dense(), 12, 40, 28, 0),        # Perceiver-AR latents: the last 12 of a 40-key stream
    (Pattern.dense(), 12, 30, 13, -3),       # keys before the start (a ring halo on device 0)
    (Pattern.dense(), 8, 8, 0, 16),          # every key in the future: no row sees anything
    (Pattern.dense(), 10, 10, 30, 12),       # a ring step wholly in the past
    (Pattern.sliding(5), 12, 30, 13, -3),
    (Pattern.sliding(6), 9, 40, 20, 0),      # a chunk of queries against the whole sequence
    (Pattern.blocks(4, 1), 12, 30, 13, 2),   # a chunk that starts inside a block
    (Pattern.blocks(4, 1), 12, 30, 16, 2),
    (Pattern.blocks(8), 16, 24, 8, 0),
    (Pattern.pi(3, 4, 3), 9, 30, 20, 0),
    (Pattern.pi(3, 5, 4), 10, 25, 15, 5),    # skips before the keys' start: absent
]


@pytest.mark.parametrize("traced,block_sizes", fast_first([(False, "tiny"), (True, "tiny"), (False, "default")], keep=2),
                         ids=["static", "static-tiny", "traced-tiny"], indirect=["block_sizes"])
@pytest.mark.parametrize("pattern,Tq,Tk,q_start,k_start", fast_first(OFFSET_CASES, keep=(1, 6, 9)),
                         ids=lambda x: repr(x))
def test_offsets_match_reference(pattern, Tq, Tk, q_start, k_start, traced, block_sizes):
  check(pattern, Tq, Tk, q_start=q_start, k_start=k_start, traced=traced, seed=Tq + q_start)


# π's wide windows: a window too wide for the band (here block 8 and a band cap of 16 keys, as a
# window of 8192 is at the tuned sizes) takes the looped schedule, whose key-block loop covers the
# window alone; the skips are the stride piece beside it (`xla.stride_attend`).

WIDE_CASES = [
    # (pattern, Tq, Tk, q_start, k_start)
    (Pattern.pi(40, 64, 3), 128, 128, 0, 0),  # block 8, window 40, period 64
    (Pattern.pi(12, 16, 3), 61, 61, 0, 0),    # ragged: a last query block past Tq
    (Pattern.pi(12, 16, 3), 20, 45, 30, 5),   # a chunk: skips before the keys' start are absent
    (Pattern.pi(12, 16, 3), 16, 40, 20, -6),  # keys before the sequence start (a ring halo)
]


@pytest.fixture
def wide_windows(monkeypatch):
  monkeypatch.setattr(core.plan, "Q_BLOCK", 8)
  monkeypatch.setattr(core.plan, "K_BLOCK", 8)
  monkeypatch.setattr(core.plan, "MAX_BAND", 16)


@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced"])
@pytest.mark.parametrize("pattern,Tq,Tk,q_start,k_start", fast_first(WIDE_CASES, keep=(0, 3)),
                         ids=lambda x: repr(x))
def test_wide_window_skips_match_reference(pattern, Tq, Tk, q_start, k_start, traced,
                                           wide_windows):
  plan = core.plan_for(pattern, Tq, Tk, q_start=q_start, k_start=k_start)
  assert plan.schedule == "loop" and plan.pattern == pattern.local
  check(pattern, Tq, Tk, q_start=q_start, k_start=k_start, traced=traced, seed=Tq)


def _check_documents(pattern, T, ids, args, cotangents):
  """`core.attend` with document ids against the reference masked to each document."""
  local, skip = reference_masks(pattern, np.arange(T), np.arange(T))
  same = np.asarray(ids)[:, None, :, None] == np.asarray(ids)[:, None, None, :]
  fast = lambda q, k, v, lp, sp: core.attend(q, k, v, pattern, local_prior=lp, skip_prior=sp,
                                             q_segments=ids, k_segments=ids)
  slow = lambda q, k, v, lp, sp: reference_attend(q, k, v, local & same, skip & same, lp, sp)
  assert_matches(fast, slow, args, cotangents, atol=2e-5)


def test_wide_window_skips_keep_documents(wide_windows):
  """The stride drops a key of another document (values and gradients against the reference)."""
  pattern, T = Pattern.pi(12, 16, 3), 64
  args, cotangents = random_inputs(T, T, seed=5, priors=(True, True))
  ids = jnp.asarray(np.repeat(np.array([[0, 1, 2, 3], [0, 0, 1, 1]]), 16, axis=1), jnp.int32)
  _check_documents(pattern, T, ids, args, cotangents)


# π's stride: the skips as one piece (`xla.stride_attend`), run either way: as one shifted view of
# the keys per skip distance (a static key offset and at most `xla.stride.SHIFT_SKIPS` skips that
# land), or as the row call (keys viewed as `[T / period, period]`, a window of rows per column).
# Periods not dividing T, more skips than T / period, back to the sequence start (num_skips None),
# offsets (static and traced), keys before the sequence start.


@pytest.fixture(params=["shifts", "rows"])
def stride_way(request, monkeypatch):
  """Every stride as shifts (any skip count), or every one as the row call."""
  from efficient_lm.ops.core.xla import stride
  monkeypatch.setattr(stride, "SHIFT_SKIPS", 10 ** 6 if request.param == "shifts" else 0)
  return request.param

STRIDE_CASES = [
    # (pattern, Tq, Tk, q_start, k_start)
    (Pattern.pi(3, 7, None), 45, 45, 0, 0),     # every 7th key back to the start; 7 does not divide 45
    (Pattern.pi(4, 5, 40), 37, 37, 0, 0),       # 40 skips, at most 7 land
    (Pattern.pi(5, 2, 6), 40, 40, 0, 0),        # period < window: the skips from 3 periods back
    (Pattern.pi(3, 4, None), 13, 30, 20, 3),    # a chunk: skips before the keys' start are absent
    (Pattern.pi(2, 3, 9), 16, 40, 20, -6),      # keys before the sequence start (a ring halo)
]


@pytest.mark.parametrize("traced,layout", [(False, "BTHK"), (True, "BHTK")], ids=["static", "traced"])
@pytest.mark.parametrize("pattern,Tq,Tk,q_start,k_start", STRIDE_CASES, ids=lambda x: repr(x))
def test_stride_matches_reference(pattern, Tq, Tk, q_start, k_start, traced, layout, stride_way):
  check(pattern, Tq, Tk, q_start=q_start, k_start=k_start, traced=traced, layout=layout, seed=Tq)


def test_stride_keeps_documents(stride_way):
  """A skip key of another document is dropped, back to the sequence start (values, gradients)."""
  pattern, T = Pattern.pi(2, 3, None), 50
  args, cotangents = random_inputs(T, T, seed=6, priors=(True, True))
  ids = jnp.asarray(np.stack([np.arange(T) // 13, np.arange(T) // 30]), jnp.int32)
  _check_documents(pattern, T, ids, args, cotangents)


def test_stride_in_a_decoding_cache():
  """Explicit key positions (a ring buffer with an empty slot) mask the stride in the loop."""
  check(Pattern.pi(2, 3, None), 2, 8, q_start=9, k_positions=[8, 1, 2, 3, -1, 5, 6, 7], seed=3)


def _stride_program(pattern, T):
  """The lowered StableHLO of the core's forward + backward with both priors at length T."""
  args, _ = random_inputs(T, T, B=1, H=1, priors=(True, True))
  loss = lambda *a: sum(jnp.sum(x) for x in core.attend(*a[:3], pattern, local_prior=a[3],
                                                         skip_prior=a[4]))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).as_text()


def test_stride_program_does_not_grow_with_skips():
  """Past `xla.stride.SHIFT_SKIPS`, 60 skips compile to about the program of SHIFT_SKIPS + 1 (one
  row call, not one piece per skip)."""
  from efficient_lm.ops.core.xla import stride
  few = _stride_program(Pattern.pi(4, 2, stride.SHIFT_SKIPS + 2), 128).count("\n")
  many = _stride_program(Pattern.pi(4, 2, 60), 128).count("\n")
  assert many < 1.2 * few, (few, many)


def test_stride_way_per_call():
  """A few skips (π's default: 3) run as shifts, many as the row call; a traced key offset too."""
  from efficient_lm.ops.core.xla import stride
  call = lambda pattern, T, **kw: core._call(jnp.zeros((1, T, 1, 8)), jnp.zeros((1, T, 1, 8)),
                                             pattern, None, kw.get("q_start", 0), 0, None, 1,
                                             None, None, None, None, "BTHK")[0]
  assert stride._shift_skips(call(Pattern.pi(128, 128, 3), 1024)) == (1, 2, 3)
  assert stride._shift_skips(call(Pattern.pi(128, 128, 3), 200)) == (1,)  # the skips that land
  assert stride._shift_skips(call(Pattern.pi(32, 16, 63), 1024)) is None
  assert stride._shift_skips(call(Pattern.pi(4, 2, 3), 64, q_start=jnp.int32(5))) is None


def test_stride_piece_keeps_only_inputs_outputs_and_lse(stride_way):
  """The stride piece alone (what a kernel's π call differentiates through `xla.stride_attend`)
  keeps q, k, v, its o, lse and the prior: never the shifted keys nor padded column copies."""
  from efficient_lm.ops.core import xla
  B, T, H, K = 1, 512, 2, 8
  (q, k, v, _, sp), cotangents = random_inputs(T, T, B=B, H=H, K=K, priors=(False, True))
  pattern = Pattern.pi(32, 48, 4)
  c = core._call(q, k, pattern, None, 0, 0, None, 1, None, None, sp, None, "BTHK")[0]
  fast = lambda q, k, v, lp, sp: xla.stride_attend(c, q, k, v, 0, sp)
  saved = residuals(lambda q, k, v, sp: fast(q, k, v, None, sp), q, k, v, sp)
  assert max(x.size for x in saved) <= B * T * H * K
  assert len([x for x in saved if x.size == B * T * H * K]) == 4  # q, k, v, o
  assert sum(x.size for x in saved) <= 4 * B * T * H * K + 2 * B * T * H
  _, skip = reference_masks(pattern, np.arange(T), np.arange(T))
  slow = lambda q, k, v, lp, sp: reference_attend(q, k, v, np.zeros_like(skip), skip, lp, sp)
  assert_matches(fast, slow, (q, k, v, None, sp), cotangents)


def test_stride_builds_no_quadratic_array():
  """No array of the stride's program holds T^2 / 8 elements (T = 1024, period 4, 8 skips)."""
  import re
  T = 1024
  text = _stride_program(Pattern.pi(8, 4, 8), T)
  sizes = [int(np.prod([int(d) for d in m.split("x")])) for m in
           re.findall(r"tensor<((?:\d+x)+)(?:f32|i32|i1|bf16)>", text)
           for m in [m.rstrip("x")]]
  assert max(sizes) < T * T // 8, max(sizes)


@pytest.mark.parametrize("q_start", [0, 37])
def test_looped_schedule_visits_only_seen_key_blocks(q_start, wide_windows):
  """Each query block's key-block loop covers only blocks holding a key one of its queries sees
  locally (π's skips come as the stride piece), and every such block: O(T (W + S)), not O(T S P)."""
  from efficient_lm.ops.core.xla import looped
  pattern, Tq, Tk = Pattern.pi(40, 64, 3), 96, 96 + q_start
  plan = core.plan_for(pattern, Tq, Tk, q_start=q_start, k_start=0)
  assert plan.schedule == "loop" and not plan.pattern.has_skips
  NK = -(-Tk // plan.k_block)
  local, _ = reference_masks(pattern, q_start + np.arange(Tq), np.arange(Tk))
  for i in range(-(-Tq // plan.q_block)):
    rows = local[i * plan.q_block:(i + 1) * plan.q_block]
    seen = {j for j in range(NK) if rows[:, j * plan.k_block:(j + 1) * plan.k_block].any()}
    lo, hi = looped._key_blocks(plan, q_start, 0, i, NK)
    assert set(range(lo, hi)) == seen, (i, lo, hi, sorted(seen))


# Explicit key positions: decoding caches (ring buffers with empty slots, -1), both layouts.

POSITION_CASES = [
    (Pattern.dense(), 1, [0, 1, 2, 3, 4, -1, -1, -1], 4),
    (Pattern.dense(), 3, [8, 9, 2, 3, 4, 5, 6, 7, 10, 11, 12], 10),  # a chunk after the cache
    (Pattern.sliding(4), 2, [4, 5, 6, 3], 6),
    (Pattern.blocks(4), 1, [8, 9, -1, -1], 9),
    (Pattern.blocks(4, 1), 3, [4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10], 8),
    (Pattern.pi(3, 4, 3), 5, [4, -1, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12], 8),
    (Pattern.pi(2, 3, 2), 1, [6, 1, 2, 3, 4, 5, -1], 6),
    (Pattern.dense(), 2, [-1, -1, -1], 0),  # an empty cache: no row sees anything
]


@pytest.mark.parametrize("layout,block_sizes", fast_first([("BTHK", "default"), ("BHTK", "tiny"),
                                                           ("BHTK", "default")], keep=2),
                         indirect=["block_sizes"])
@pytest.mark.parametrize("pattern,Tq,positions,q_start", fast_first(POSITION_CASES, keep=(0, 5)),
                         ids=lambda x: repr(x))
def test_explicit_positions_match_reference(pattern, Tq, positions, q_start, layout, block_sizes):
  check(pattern, Tq, len(positions), q_start=q_start, k_positions=positions, layout=layout,
        seed=len(positions))


@pytest.mark.parametrize("pattern", fast_first([Pattern.pi(3, 5, 3), Pattern.sliding(6),
                                                 Pattern.blocks(4, 1), Pattern.dense()]), ids=repr)
def test_query_chunks_in_a_scan_equal_one_call(pattern, block_sizes):
  """Sequence chunking: chunks of 8 queries at a traced q_start (a lax.scan under remat), each
  against the whole sequence's keys, equal one call, in values and in every gradient."""
  args, cotangents = random_inputs(32, 32, seed=13, priors=(pattern.has_skips,) * 2)

  def chunked(q, k, v, lp, sp):
    split = lambda x: None if x is None else jnp.swapaxes(x.reshape(x.shape[0], 4, 8, *x.shape[2:]), 0, 1)

    @jax.checkpoint
    def one(q_c, lp_c, sp_c, start):
      return core.attend(q_c, k, v, pattern, q_start=start, local_prior=lp_c, skip_prior=sp_c)

    def body(_, xs):
      q_c, lp_c, sp_c, start = xs
      return None, one(q_c, lp_c, sp_c, start)

    _, (o, lse) = jax.lax.scan(body, None, (split(q), split(lp), split(sp), 8 * jnp.arange(4)))
    merge = lambda x: jnp.swapaxes(x, 0, 1).reshape(x.shape[1], 32, *x.shape[3:])
    return merge(o), merge(lse)

  whole = lambda q, k, v, lp, sp: core.attend(q, k, v, pattern, local_prior=lp, skip_prior=sp)
  assert_matches(chunked, whole, args, cotangents)


def test_traced_positions_and_start_under_jit():
  """Decoding passes the start and the slot positions as traced values."""
  pattern = Pattern.pi(3, 4, 3)
  positions = jnp.asarray([4, -1, 6, 7, 0, 1, 2, 3], jnp.int32)
  (q, k, v, lp, sp), _ = random_inputs(2, 8, priors=(True, True))
  fast = jax.jit(lambda q, k, v, pos, start: core.attend(
      q, k, v, pattern, q_start=start, k_positions=pos, local_prior=lp, skip_prior=sp))
  local, skip = reference_masks(pattern, 8 + np.arange(2), np.asarray(positions))
  o, lse = fast(q, k, v, positions, jnp.int32(8))
  ro, rlse = reference_attend(q, k, v, local, skip, lp, sp)
  np.testing.assert_allclose(o, ro, atol=2e-5)
  np.testing.assert_allclose(lse, rlse, atol=2e-5)


@pytest.mark.slow
def test_priors_give_one_softmax_over_the_union(block_sizes):
  """Priors on a skip-free pattern, on both parts of π, and a scale."""
  check(Pattern.sliding(6), 30, 30, priors=(True, False), seed=3)
  check(Pattern.pi(4, 6, 4), 40, 40, priors=(True, True), seed=4, scale=0.3)
  check(Pattern.pi(4, 6, 4), 40, 40, priors=(False, True), seed=5)
  # The union softmax: the local part alone and the skip part alone, merged by lse, equal the call.
  args, _ = random_inputs(40, 40, seed=6, priors=(True, True))
  q, k, v, lp, sp = args
  both = core.attend(q, k, v, Pattern.pi(4, 6, 4), local_prior=lp, skip_prior=sp)
  local_only = core.attend(q, k, v, Pattern.sliding(4), local_prior=lp)
  local, skip = reference_masks(Pattern.pi(4, 6, 4), np.arange(40), np.arange(40))
  skip_only = reference_attend(q, k, v, np.zeros_like(skip), skip, None, sp)
  merged = core.merge([local_only, skip_only])
  np.testing.assert_allclose(both[0], merged[0], atol=2e-5)
  np.testing.assert_allclose(both[1], merged[1], atol=2e-5)


@pytest.mark.slow
def test_rows_without_keys_are_zero_and_finite(block_sizes):
  """o = 0, lse = NO_KEY_LSE (finite), no NaN in any gradient, and merge weights such rows 0."""
  (q, k, v, _, _), (cot_o, cot_lse) = random_inputs(6, 6, seed=7)
  fn = lambda q, k, v: core.attend(q, k, v, Pattern.dense(), q_start=0, k_start=3)  # rows 0-2 empty
  o, lse = fn(q, k, v)
  np.testing.assert_array_equal(o[:, :3], 0.0)
  np.testing.assert_array_equal(lse[:, :3], np.float32(core.NO_KEY_LSE))
  assert np.all(np.isfinite(lse))
  grads = jax.grad(lambda *a: jnp.sum(fn(*a)[0] * cot_o) + jnp.sum(fn(*a)[1] * cot_lse),
                   argnums=(0, 1, 2))(q, k, v)
  assert all(np.all(np.isfinite(g)) for g in grads)
  np.testing.assert_array_equal(grads[0][:, :3], 0.0)  # an empty row's query gets no gradient
  other = core.attend(q, k, v, Pattern.dense())
  merged_o, merged_lse = core.merge([(o, lse), other])
  np.testing.assert_allclose(merged_o[:, :3], other[0][:, :3], atol=1e-6)
  np.testing.assert_allclose(merged_lse[:, :3], other[1][:, :3], atol=1e-6)
  empty_o, empty_lse = core.merge([(o, lse), (o, lse)])
  np.testing.assert_array_equal(empty_o[:, :3], 0.0)
  assert np.all(empty_lse[:, :3] < -1e28)


@pytest.mark.parametrize("pattern", fast_first([Pattern.pi(3, 5, 3), Pattern.dense(), Pattern.sliding(7)]),
                         ids=repr)
def test_merge_of_two_pieces_equals_one_call(pattern, block_sizes):
  """Keys split in two ranges (as a ring step does): merge of the two calls = one call, in values
  and in gradients."""
  args, cotangents = random_inputs(20, 32, seed=8, priors=(pattern.has_skips,) * 2)

  def pieces(q, k, v, lp, sp):
    kw = dict(q_start=12, local_prior=lp, skip_prior=sp)
    first = core.attend(q, k[:, :13], v[:, :13], pattern, k_start=0, **kw)
    second = core.attend(q, k[:, 13:], v[:, 13:], pattern, k_start=13, **kw)
    return core.merge([first, second])

  whole = lambda q, k, v, lp, sp: core.attend(q, k, v, pattern, q_start=12, local_prior=lp,
                                              skip_prior=sp)
  assert_matches(pieces, whole, args, cotangents)


@pytest.mark.parametrize("pattern,T", fast_first([(Pattern.pi(4, 6, 4), 40), (Pattern.dense(), 40),
                                                  (Pattern.sliding(8), 40), (Pattern.blocks(8, 1), 37)]),
                         ids=lambda x: repr(x))
def test_bfloat16_inputs(pattern, T, block_sizes):
  """bf16 q, k, v: o in bf16, lse in float32, close to the float32 reference on the same values."""
  args, cotangents = random_inputs(T, T, seed=9, dtype=jnp.bfloat16, priors=(pattern.has_skips,) * 2)
  local, skip = reference_masks(pattern, np.arange(T), np.arange(T))
  fast = lambda *a: core.attend(*a[:3], pattern, local_prior=a[3], skip_prior=a[4])
  o, lse = fast(*args)
  assert o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  f32_args = tuple(None if a is None else a.astype(jnp.float32) for a in args)
  ro, rlse = reference_attend(*f32_args[:3], local, skip, *f32_args[3:])
  np.testing.assert_allclose(np.asarray(o, np.float32), ro, atol=3e-2, rtol=3e-2)
  np.testing.assert_allclose(lse, rlse, atol=3e-2, rtol=1e-2)
  (_, grads) = jax.jit(lambda *a: value_and_grads(fast, a, cotangents))(*args)
  (_, rgrads) = jax.jit(lambda *a: value_and_grads(
      lambda *b: reference_attend(*b[:3], local, skip, *b[3:]), a, cotangents))(*f32_args)
  for g, rg in zip(grads, rgrads):
    assert g.dtype == (jnp.bfloat16 if g.ndim == 4 else jnp.float32)
    np.testing.assert_allclose(np.asarray(g, np.float32), rg, atol=0.1, rtol=0.1)


# Memory: what the backward keeps, and how the compiled temporaries grow.

def residuals(fn, *args) -> list[jax.Array]:
  """The arrays `jax.vjp` keeps for the backward pass."""
  _, f_vjp = jax.vjp(fn, *args)
  return [x for x in jax.tree.leaves(f_vjp) if hasattr(x, "shape")]


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [Pattern.pi(32, 48, 4), Pattern.dense(), Pattern.sliding(32),
                                     Pattern.blocks(64, 1)], ids=repr)
def test_backward_keeps_only_inputs_outputs_and_lse(pattern):
  """Nothing of size [.., L, M] or [T, T] lives between forward and backward: every residual is
  at most the size of q (q, k, v, o), or of a [B, T, H] row (priors, lse)."""
  B, T, H, K = 1, 512, 2, 8
  (q, k, v, lp, sp), _ = random_inputs(T, T, B=B, H=H, K=K, priors=(True, True))
  if not pattern.has_skips:
    sp = None
  saved = residuals(lambda q, k, v, lp: core.attend(q, k, v, pattern, local_prior=lp,
                                                    skip_prior=sp), q, k, v, lp)
  assert saved, "the vjp keeps something"
  assert max(x.size for x in saved) <= B * T * H * K
  q_sized = [x for x in saved if x.size == B * T * H * K]
  assert len(q_sized) == 4  # q, k, v, o
  assert sum(x.size for x in saved) <= 4 * B * T * H * K + 3 * B * T * H


def fwd_bwd_temp_bytes(op, T, B=1, H=2, K=16, **compiler_options) -> int:
  shape = jax.ShapeDtypeStruct((B, T, H, K), jnp.float32)
  step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(op(q, k, v) ** 2), argnums=(0, 1, 2)))
  compiled = step.lower(shape, shape, shape).compile(compiler_options or None)
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("name,op", [
    ("dense", attention.causal_attention),
    ("sliding", functools.partial(attention.sliding_window_attention, window=256)),
    ("pi", lambda q, k, v: attention.pi_attention(q, k, v, jnp.full(q.shape[:3], 0.5), window=256,
                                                  period=512, num_skips=3)),
])
def test_compiled_memory_doubles_with_T(name, op):
  """fwd+bwd temporaries grow like T (x2 per doubling), not like T^2 (x4)."""
  small, large = fwd_bwd_temp_bytes(op, 4096), fwd_bwd_temp_bytes(op, 8192)
  assert large <= 2.3 * small, (name, small, large)
  if name == "dense":  # the dense reference holds [T, T] scores: far more at the same T
    reference = fwd_bwd_temp_bytes(functools.partial(attention.causal_attention, impl="reference"),
                                   4096)
    assert small * 8 < reference, (small, reference)


def test_test_compile_mode_keeps_the_compiled_memory():
  """tests/conftest.py compiles with jax_disable_most_optimizations (LLVM -O0) and XLA's classic
  CPU fusion emitters where jaxlib has them (faster compiles); the memory figures the tests check
  come from HLO passes and buffer assignment, the same either way."""
  op = functools.partial(attention.sliding_window_attention, window=64)
  choices = (False, True) if jax_compat.classic_cpu_emitters_flag() else (None,)
  figures = {}
  for disabled in (True, False):
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", disabled)
    try:
      for emitters in choices:  # a fresh jit each time
        options = {} if emitters is None else {"xla_cpu_use_fusion_emitters": emitters}
        figures[disabled, emitters] = fwd_bwd_temp_bytes(op, 1024, **options)
    finally:
      jax.config.update("jax_disable_most_optimizations", previous)
  assert len(set(figures.values())) == 1, figures


# Layouts, errors and the causal op's implementations.

def test_layouts_agree():
  (q, k, v, lp, _), _ = random_inputs(24, 24, seed=10, priors=(True, False))
  o, lse = core.attend(q, k, v, Pattern.sliding(5), local_prior=lp)
  heads = lambda x: jnp.swapaxes(x, 1, 2)
  o2, lse2 = core.attend(heads(q), heads(k), heads(v), Pattern.sliding(5), local_prior=heads(lp),
                         layout="BHTK")
  np.testing.assert_allclose(heads(o2), o, atol=1e-6)
  np.testing.assert_allclose(heads(lse2), lse, atol=1e-6)


def test_bad_calls_are_named():
  (q, k, v, _, _), _ = random_inputs(8, 8)
  for call, match in [
      (lambda: core.attend(q, k, v, Pattern.dense(), layout="TBHK"), "layout"),
      (lambda: core.attend(q, k[:, :, :1], v, Pattern.dense()), "disagree"),
      (lambda: core.attend(q, k, v, Pattern.dense(), local_prior=jnp.zeros((2, 8))), "local_prior"),
      (lambda: core.attend(q, k, v, Pattern.dense(), k_positions=jnp.zeros(5, jnp.int32)),
       "k_positions"),
      (lambda: core.attend(q, k, v, "dense"), "pattern"),
      (lambda: core.merge([]), "at least one"),
  ]:
    with pytest.raises(ValueError, match=match):
      call()


def test_causal_attention_impls():
  (q, k, v, _, _), _ = random_inputs(33, 33, seed=11)
  np.testing.assert_allclose(attention.causal_attention(q, k, v),
                             attention.causal_attention(q, k, v, impl="reference"), atol=2e-5)
  with pytest.raises(ValueError, match="attention impl 'bogus' is not one of auto, xla, splash"):
    attention.causal_attention(q, k, v, impl="bogus")
  if jax.default_backend() != "gpu":  # a kernel off its hardware: only interpreted
    with pytest.raises(ValueError, match="impl='gpu': the 'gpu' kernels need a GPU"):
      attention.causal_attention(q, k, v, impl="cudnn")


@pytest.mark.slow
def test_attention_impl_field():
  """model.attention_impl: 'reference' and 'flash' (= 'xla') build the same dense model; bad
  values and a kernel off its hardware (not interpreted) are config errors naming the field."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from efficient_lm import models  # pylint: disable=import-outside-toplevel
  from efficient_lm.config.errors import ConfigError  # pylint: disable=import-outside-toplevel
  from test_models import tiny_model_config  # pylint: disable=import-outside-toplevel
  tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 64)
  logits = {impl: models.create(tiny_model_config("dense", attention_impl=impl),
                                rngs=nnx.Rngs(0))(tokens) for impl in ("flash", "reference")}
  np.testing.assert_allclose(logits["flash"], logits["reference"], atol=2e-5, rtol=2e-5)
  with pytest.raises(ConfigError, match="^model.attention_impl='fast' is not a known"):
    models.validate(tiny_model_config("dense", attention_impl="fast"))
  for impl, platform in (("cudnn", "gpu"), ("splash", "tpu")):
    with pytest.raises(ConfigError, match=f"^model.attention_impl='{impl}' cannot run here: the "
                       f"'{backends.canonical(impl)}' kernels need a {platform.upper()}"):
      models.validate(tiny_model_config("dense", attention_impl=impl), "cpu")
    models.validate(tiny_model_config("dense", attention_impl=impl), platform)  # there: fine
    models.validate(tiny_model_config("dense", attention_impl=impl, kernel_interpret=True), "cpu")


# π's gate as logits: exact log-priors near 0 and 1.

@pytest.mark.slow
@pytest.mark.parametrize("logit", [-12.0, 12.0])
def test_gate_logits_give_exact_priors_and_live_gradients(logit):
  z = np.full((2, 40, 2), logit, np.float32)
  z[0, ::3] += 0.5  # not every row the same
  local, skip = priors.gate_priors(gate_logits_BTH=jnp.asarray(z))
  z64 = z.astype(np.float64)
  np.testing.assert_allclose(local, -np.log1p(np.exp(-z64)), atol=1e-3, rtol=0)
  np.testing.assert_allclose(skip, -np.log1p(np.exp(z64)), atol=1e-3, rtol=0)
  # pi_attention with the logits is the core with those priors ...
  (q, k, v, _, _), (cot_o, _) = random_inputs(40, 40, seed=12)
  kw = dict(window=4, period=6, num_skips=4)
  op = lambda q, k, v, z: attention.pi_attention(q, k, v, gate_logits_BTH=z, **kw)
  got = op(q, k, v, jnp.asarray(z))
  lmask, smask = reference_masks(Pattern.pi(4, 6, 4), np.arange(40), np.arange(40))
  exact = lambda a: jnp.asarray(a.astype(np.float32))
  want, _ = reference_attend(q, k, v, lmask, smask, exact(-np.log1p(np.exp(-z64))),
                             exact(-np.log1p(np.exp(z64))))
  np.testing.assert_allclose(got, want, atol=2e-5)
  # ... with finite gate gradients that are not zero where a skip lands (position >= 6).
  grad_z = jax.grad(lambda z: jnp.sum(op(q, k, v, z) * cot_o))(jnp.asarray(z))
  assert np.all(np.isfinite(grad_z))
  assert np.all(grad_z[:, 6:] != 0)
  # Before the first skip the gate shifts every logit of a row equally: only rounding is left.
  assert np.median(np.abs(grad_z[:, 6:])) > 10 * np.abs(grad_z[:, :6]).max()
  if logit > 0:  # the sigmoid-then-log path is not exact here: g rounds towards 1
    _, skip_from_gate = priors.gate_priors(gate_BTH=jax.nn.sigmoid(jnp.asarray(z)))
    assert np.abs(skip_from_gate - (-np.log1p(np.exp(z64)))).max() > 1e-3


def test_exactly_one_gate_form():
  (q, k, v, _, _), _ = random_inputs(8, 8)
  gate = jnp.full((2, 8, 2), 0.5)
  for kw in ({}, {"gate_BTH": gate, "gate_logits_BTH": gate}):
    with pytest.raises(ValueError, match="exactly one of gate_BTH"):
      attention.pi_attention(q, k, v, window=2, period=2, num_skips=2, **kw)


# The Pattern itself.

PATTERNS = [Pattern.dense(), Pattern.sliding(3), Pattern.blocks(4), Pattern.blocks(3, 2),
            Pattern.segments(4), Pattern.pi(3, 4, 3), Pattern.pi(2, 1, 5), Pattern(window=5, block_size=4)]


@pytest.mark.parametrize("pattern", PATTERNS, ids=repr)
def test_pattern_visibility_extents_and_span(pattern):
  q_pos, k_pos = np.arange(30), np.arange(-3, 30)  # negative keys: empty slots
  local, skip = reference_masks(pattern, q_pos, k_pos)
  np.testing.assert_array_equal(pattern.local_visible(q_pos[:, None], k_pos[None]), local)
  np.testing.assert_array_equal(pattern.skip_visible(q_pos[:, None], k_pos[None]), skip)
  np.testing.assert_array_equal(pattern.visible(q_pos[:, None], k_pos[None]), local | skip)
  seen = local | skip
  if pattern.reach is None:
    assert pattern.causal and any(seen[29, k_pos == 0])
  else:  # the farthest distance seen, and a cache of reach + 1 slots holds it
    distances = (q_pos[:, None] - k_pos[None])[seen]
    assert distances.max() == pattern.reach
    assert pattern.span(1000) == pattern.reach + 1 and pattern.span(2) == min(2, pattern.reach + 1)
  for first, last in [(0, 0), (5, 9), (12, 12), (17, 29)]:
    rows = seen[first:last + 1].any(axis=0)
    lo, hi = pattern.key_range(first, last)
    assert lo == k_pos[rows].min()
    if hi is not None:
      assert hi >= k_pos[rows].max() and (not pattern.causal or hi == k_pos[rows].max())
    traced = jax.jit(lambda a, b: pattern.key_range(a, b)[0])(jnp.int32(first), jnp.int32(last))
    assert int(traced) == lo


def test_pattern_constructors_and_errors():
  assert Pattern.pi(4, 2, 5).skip_offsets() == (4, 6, 8, 10)  # skips inside the window are local keys
  assert Pattern.pi(4, 2, 5) == Pattern(window=4, period=2, skip_from=2, skip_to=5)  # one stride
  assert Pattern.pi(4, 8, 5, seq_len=20).skip_offsets() == (8, 16)
  assert Pattern.pi(4, 8, 2, seq_len=8) == Pattern.sliding(4)  # no skip lands
  back = Pattern.pi(3, 7, None)  # every 7th key back to the sequence start
  assert back.skip_offsets(seq_len=30) == (7, 14, 21, 28) and back.reach is None
  assert back.key_range(100, 107) == (0, 107) and Pattern.pi(3, 7, 2).key_range(100, 107) == (86, 107)
  assert Pattern.pi(32, 16, 63, seq_len=1024).skip_offsets() == tuple(range(32, 1024, 16))
  assert Pattern.dense().span(77) == 77 and Pattern.sliding(8).reach == 7
  assert Pattern.blocks(4, 1).reach == 7 and Pattern.pi(4, 8, 3).reach == 24
  assert hash(Pattern.pi(4, 8, 3)) == hash(Pattern.pi(4, 8, 3))
  for make, match in [(lambda: Pattern.sliding(0), "window"),
                      (lambda: Pattern.blocks(4, -1), "lookback"),
                      (lambda: Pattern(window=4, period=2), "skip_from"),  # a skip in the window
                      (lambda: Pattern(period=8), "period"),  # skips need a causal window
                      (lambda: Pattern(window=4, period=4, skip_from=2, skip_to=1), "skip_to"),
                      (lambda: Pattern(window=4, skip_to=3), "period"),
                      (lambda: back.skip_offsets(), "seq_len"),
                      (lambda: Pattern.pi(4, 0, 2), "period"),
                      (lambda: Pattern.pi(4, 2, -1), "num_skips")]:
    with pytest.raises(ValueError, match=match):
      make()
