"""The gated delta rule (`ops.recurrent`) against its plain per-token recurrence: forward, final
state and every gradient, with documents, T not a multiple of the chunk, an initial state, the
extremes of beta and g; causality, jit, bfloat16, decoding step by step, memory linear in T."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first
from efficient_lm.ops import recurrent


def reference(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH=None, *, scale=None, segment_ids=None,
              initial_state=None):
  """The recurrence as defined, one token at a time (`lax.scan` over T), float32: at a document's
  first token S = 0; S <- exp(g) S; then the delta rule S <- S + beta k (v - S^T k)^T, or with
  `beta_BTH=None` the gated linear rule (Mamba-2's) S <- S + k v^T; o = S^T (scale q)."""
  B, T, H, K = q_BTHK.shape
  V = v_BTHV.shape[-1]
  scale = K ** -0.5 if scale is None else scale
  starts_BT = np.zeros((B, T), bool)
  if segment_ids is not None:
    ids = np.asarray(segment_ids)
    starts_BT[:, 1:] = ids[:, 1:] != ids[:, :-1]
  S_BHKV = jnp.zeros((B, H, K, V)) if initial_state is None else initial_state.astype(jnp.float32)
  delta = beta_BTH is not None

  def token(S_BHKV, x):
    q_BHK, k_BHK, v_BHV, g_BH, beta_BH, start_B = x
    S_BHKV = jnp.where(start_B[:, None, None, None], 0.0, S_BHKV)
    S_BHKV = jnp.exp(g_BH)[..., None, None] * S_BHKV
    if delta:
      write_BHV = beta_BH[..., None] * (v_BHV - jnp.einsum("bhkv,bhk->bhv", S_BHKV, k_BHK))
    else:
      write_BHV = v_BHV
    S_BHKV = S_BHKV + k_BHK[..., :, None] * write_BHV[..., None, :]
    return S_BHKV, jnp.einsum("bhkv,bhk->bhv", S_BHKV, scale * q_BHK)

  beta_BTH = jnp.zeros_like(g_BTH) if beta_BTH is None else beta_BTH
  xs = [jnp.swapaxes(jnp.asarray(x, jnp.float32), 0, 1)
        for x in (q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH)]
  final_BHKV, o_TBHV = jax.lax.scan(token, S_BHKV, (*xs, jnp.swapaxes(starts_BT, 0, 1)))
  return jnp.swapaxes(o_TBHV, 0, 1), final_BHKV


def inputs(B, T, H, K, V, seed=0, beta_range=(-2.0, 2.0), g_shift=0.0):
  """q, k (L2-normalised, as the model's), v, g = log sigmoid(.) - g_shift <= 0, beta in (0, 1)."""
  keys = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(keys[0], (B, T, H, K))
  k = jax.random.normal(keys[1], (B, T, H, K))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jax.random.normal(keys[2], (B, T, H, V))
  g = jax.nn.log_sigmoid(jax.random.normal(keys[3], (B, T, H)) + 2.0) - g_shift
  beta = jax.nn.sigmoid(jax.random.uniform(keys[4], (B, T, H), minval=beta_range[0],
                                           maxval=beta_range[1]))
  return q, k, v, g, beta


def documents(B, T, seed=0):
  """`[B, T]` ids of random documents: some one token long, some across several chunks; the ids
  repeat (a later document may reuse an earlier id: only a change starts one)."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((B, T), np.int32)
  for b in range(B):
    cuts = np.sort(rng.choice(np.arange(1, T), size=min(T - 1, max(1, T // 9)), replace=False))
    ids[b] = np.searchsorted(cuts, np.arange(T), side="right") % 3
  return jnp.asarray(ids)


def assert_close(got, want, rtol=1e-5):
  """Equal to `rtol` relative, element-wise, with entries near 0 measured against the array's
  largest magnitude."""
  want = np.asarray(want, np.float64)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol,
                             atol=rtol * float(np.max(np.abs(want)) or 1.0))


def values_and_grads(op, args, cot_o, cot_s):
  """(o, final state, gradients of <o, cot_o> + <final, cot_s> w.r.t. every array in args)."""
  def loss(*a):
    o, final = op(*a)
    return jnp.sum(o * cot_o) + jnp.sum(final * cot_s)
  o, final = jax.jit(op)(*args)
  return o, final, jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)


def assert_same_function(op, args, rtol=1e-5, seed=7, **kw):
  """`op(*args, **kw)` equals the reference's outputs, final state and gradients with respect
  to q, k, v, g, beta (and the initial state when given)."""
  q, _, v = args[:3]
  B, T, H, K = q.shape
  keys = jax.random.split(jax.random.key(seed), 2)
  cot_o = jax.random.normal(keys[0], v.shape)
  cot_s = jax.random.normal(keys[1], (B, H, K, v.shape[-1]))
  fast = lambda *a: op(*a[:5], **({} if len(a) == 5 else {"initial_state": a[5]}), **kw)
  ref_kw = {key: val for key, val in kw.items() if key in ("scale", "segment_ids")}
  slow = lambda *a: reference(*a[:5], **({} if len(a) == 5 else {"initial_state": a[5]}), **ref_kw)
  got, want = values_and_grads(fast, args, cot_o, cot_s), values_and_grads(slow, args, cot_o, cot_s)
  assert_close(got[0], want[0], rtol)
  assert_close(got[1], want[1], rtol)
  for name, g, w in zip("q k v g beta initial_state".split(), got[2], want[2]):
    assert np.all(np.isfinite(g)), name
    assert_close(g, w, rtol), name


def test_equals_recurrence_with_documents_at_a_ragged_length():
  """The measured goal: T = 45 over chunks of 16 (padded), documents that start inside chunks,
  at a chunk start and one token long, an initial state: outputs, final state and all six
  gradients to 1e-5 relative in float32."""
  B, T, H, K, V = 2, 45, 2, 8, 6
  args = inputs(B, T, H, K, V, seed=1)
  ids = np.array(documents(B, T, seed=1))
  ids[0, 16:] += 5   # a document starting exactly at a chunk boundary
  ids[0, 30] += 7    # a one-token document inside a chunk
  initial = 0.5 * jax.random.normal(jax.random.key(2), (B, H, K, V))
  assert_same_function(recurrent.gated_delta_rule, (*args, initial), chunk_size=16,
                       segment_ids=jnp.asarray(ids))


@pytest.mark.parametrize("B,T,H,K,V,chunk", fast_first([
    (1, 1, 1, 4, 4, 64),      # one token
    (2, 37, 3, 8, 5, 8),      # several chunks, ragged tail, V != K
    (1, 20, 2, 8, 12, 64),    # chunk_size > T
    (3, 64, 1, 16, 16, 16),   # T a multiple of the chunk
    (1, 130, 2, 8, 8, 32),    # many chunks
    (2, 50, 2, 32, 16, 7),    # an odd chunk size
], keep=3))
def test_random_shapes_with_documents(B, T, H, K, V, chunk):
  args = inputs(B, T, H, K, V, seed=T)
  assert_same_function(recurrent.gated_delta_rule, args, chunk_size=chunk,
                       segment_ids=documents(B, T, seed=T), scale=0.7)


def test_initial_state_without_documents():
  args = inputs(2, 29, 2, 8, 8, seed=3)
  initial = jax.random.normal(jax.random.key(3), (2, 2, 8, 8))
  assert_same_function(recurrent.gated_delta_rule, (*args, initial), chunk_size=8)


@pytest.mark.parametrize("case", ["beta near 0", "beta near 1", "g strongly negative", "g = 0"])
def test_extremes_of_beta_and_g(case):
  kw = {"beta near 0": dict(beta_range=(-14.0, -10.0)),
        "beta near 1": dict(beta_range=(10.0, 14.0)),
        "g strongly negative": dict(g_shift=30.0), "g = 0": {}}[case]
  q, k, v, g, beta = inputs(2, 40, 2, 8, 8, seed=4, **kw)
  if case == "g = 0":  # no decay at all: the plain delta rule
    g = jnp.zeros_like(g)
  if case == "g strongly negative":  # exp(G) underflows to 0 within a chunk, never overflows
    g = g.at[:, ::3].set(-200.0)
  initial = jax.random.normal(jax.random.key(4), (2, 2, 8, 8))
  assert_same_function(recurrent.gated_delta_rule, (q, k, v, g, beta, initial), chunk_size=16,
                       segment_ids=documents(2, 40, seed=4))


def test_documents_are_independent():
  """Each document's outputs are the recurrence run on that document alone from a zero state;
  the final state is the last document's."""
  B, T, H, K, V = 1, 40, 2, 8, 8
  q, k, v, g, beta = inputs(B, T, H, K, V, seed=5)
  ids = jnp.asarray(np.repeat([0, 1, 0], [11, 20, 9])[None])
  initial = jax.random.normal(jax.random.key(5), (B, H, K, V))
  op = jax.jit(functools.partial(recurrent.gated_delta_rule, chunk_size=16))
  o, final = op(q, k, v, g, beta, segment_ids=ids, initial_state=initial)
  for lo, hi in [(0, 11), (11, 31), (31, 40)]:
    part = lambda x: x[:, lo:hi]
    alone, alone_final = op(*map(part, (q, k, v, g, beta)),
                            initial_state=initial if lo == 0 else None)
    assert_close(o[:, lo:hi], alone)
  assert_close(final, alone_final)


def test_causal():
  """Changing every input from position t + 1 on leaves the outputs up to t unchanged; the
  gradient of an output at t with respect to later inputs is 0."""
  B, T, H, K, V, t = 1, 40, 2, 8, 8, 20
  args = inputs(B, T, H, K, V, seed=6)
  other = inputs(B, T, H, K, V, seed=60)
  changed = [jnp.concatenate([a[:, :t + 1], b[:, t + 1:]], axis=1) for a, b in zip(args, other)]
  op = jax.jit(functools.partial(recurrent.gated_delta_rule, chunk_size=16))
  o, _ = op(*args)
  o2, _ = op(*changed)
  np.testing.assert_allclose(o[:, :t + 1], o2[:, :t + 1], rtol=1e-6, atol=1e-6)
  assert not np.allclose(o[:, t + 1:], o2[:, t + 1:])
  grads = jax.grad(lambda *a: jnp.sum(op(*a)[0][:, t]), argnums=(0, 1, 2, 3, 4))(*args)
  for grad in grads:
    assert np.all(np.asarray(grad)[:, t + 1:] == 0.0)
    assert np.any(np.asarray(grad)[:, :t + 1] != 0.0)


def test_jit_with_traced_documents_and_state():
  """Under jit, with segment ids, the initial state and the inputs all traced, the op equals its
  eager run."""
  B, T, H, K, V = 2, 33, 2, 8, 8
  args = inputs(B, T, H, K, V, seed=8)
  ids = documents(B, T, seed=8)
  initial = jax.random.normal(jax.random.key(8), (B, H, K, V))
  op = lambda *a, ids, initial: recurrent.gated_delta_rule(*a, segment_ids=ids, chunk_size=8,
                                                           initial_state=initial)
  jitted = jax.jit(op)(*args, ids=ids, initial=initial)
  eager = op(*args, ids=ids, initial=initial)
  for a, b in zip(jitted, eager):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_bfloat16_inputs():
  """bfloat16 inputs run (computed in float32): o in bfloat16 within its rounding of the
  recurrence on the same (rounded) inputs; the state in float32."""
  B, T, H, K, V = 2, 50, 2, 16, 16
  args = [x.astype(jnp.bfloat16) for x in inputs(B, T, H, K, V, seed=9)]
  o, final = jax.jit(functools.partial(recurrent.gated_delta_rule, chunk_size=16))(*args)
  assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
  want_o, want_final = reference(*[x.astype(jnp.float32) for x in args])
  np.testing.assert_allclose(np.asarray(o, np.float32), want_o, rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(final, want_final, rtol=1e-4, atol=1e-4)
  grads = jax.grad(lambda q, k, v: jnp.sum(recurrent.gated_delta_rule(
      q, k, v, *args[3:], chunk_size=16)[0].astype(jnp.float32)), argnums=(0, 1, 2))(*args[:3])
  assert all(grad.dtype == jnp.bfloat16 and np.all(np.isfinite(grad)) for grad in grads)


def test_decoding_steps_equal_the_whole_sequence():
  """`gated_delta_rule_step` token by token (the state zeroed at a document start, as a decoder
  does) gives the op's outputs and final state."""
  B, T, H, K, V = 2, 21, 2, 8, 4
  q, k, v, g, beta = inputs(B, T, H, K, V, seed=10)
  ids = documents(B, T, seed=10)
  initial = jax.random.normal(jax.random.key(10), (B, H, K, V))
  o, final = recurrent.gated_delta_rule(q, k, v, g, beta, segment_ids=ids, initial_state=initial,
                                        chunk_size=8, scale=0.5)
  step = jax.jit(functools.partial(recurrent.gated_delta_rule_step, scale=0.5))
  state = initial
  for t in range(T):
    if t:
      state = jnp.where((ids[:, t] != ids[:, t - 1])[:, None, None, None], 0.0, state)
    o_t, state = step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
    assert_close(o_t, o[:, t])
  assert_close(state, final)


def test_backward_keeps_no_chunk_matrices():
  """Between forward and backward only q, k, v, U', W, Kd (`[T, K]` or `[T, V]`), g, beta and
  the chunks' entering states live: no `[C, C]` matrix per chunk (they are recomputed)."""
  B, T, H, K, V, C = 1, 512, 2, 8, 8, 64
  args = inputs(B, T, H, K, V, seed=11)
  _, f_vjp = jax.vjp(lambda *a: recurrent.gated_delta_rule(*a, chunk_size=C), *args)
  saved = {id(x): x for x in jax.tree.leaves(f_vjp) if hasattr(x, "shape")}.values()
  assert saved
  assert max(x.size for x in saved) == B * T * H * K
  assert len([x for x in saved if x.size == B * T * H * K]) == 6
  states = B * H * (T // C) * K * V  # the entering states (kept twice: scan carry and output)
  assert sum(x.size for x in saved) <= 6 * B * T * H * K + 3 * B * T * H + 2 * states + 64


def temp_bytes(T: int, H: int = 2, K: int = 16) -> int:
  shape = jax.ShapeDtypeStruct((1, T, H, K), jnp.float32)
  row = jax.ShapeDtypeStruct((1, T, H), jnp.float32)
  loss = lambda q, k, v, g, beta: jnp.sum(recurrent.gated_delta_rule(q, k, v, g, beta)[0] ** 2)
  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  return step.lower(shape, shape, shape, row, row).compile().memory_analysis().temp_size_in_bytes


def test_compiled_memory_doubles_with_T():
  """fwd+bwd temporaries grow like T (x2 per doubling), not like T^2 (x4); no array in the
  program holds T^2 / 16 elements."""
  small, large = temp_bytes(2048), temp_bytes(4096)
  assert large <= 2.3 * small, (small, large)
  T = 4096
  shape = jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32)
  row = jax.ShapeDtypeStruct((1, T, 2), jnp.float32)
  text = jax.jit(jax.grad(lambda *a: jnp.sum(recurrent.gated_delta_rule(*a)[0]),
                          argnums=(0, 1, 2, 3, 4))).lower(shape, shape, shape, row, row).as_text()
  sizes = [int(np.prod([int(d) for d in m.rstrip("x").split("x")]))
           for m in re.findall(r"tensor<((?:\d+x)+)(?:f32|i32|i1|bf16)>", text)]
  assert max(sizes) < T * T // 16, max(sizes)


@pytest.mark.parametrize("change, message", [
    (dict(k=(2, 9, 2, 5)), "k has shape"),
    (dict(v=(2, 8, 2, 4)), "v has shape"),
    (dict(g=(2, 9, 3)), "g has shape"),
    (dict(beta=(2, 9)), "beta has shape"),
    (dict(segment_ids=(2, 8)), "segment_ids has shape"),
    (dict(initial_state=(2, 2, 4, 5)), "initial_state has shape"),
    (dict(chunk_size=0), "chunk_size=0"),
    (dict(impl="triton"), "impl='triton'"),
])
def test_bad_arguments_are_refused(change, message):
  shapes = dict(q=(2, 9, 2, 4), k=(2, 9, 2, 4), v=(2, 9, 2, 3), g=(2, 9, 2), beta=(2, 9, 2))
  kw = {}
  for name, value in change.items():
    if name in shapes:
      shapes[name] = value
    elif name in ("segment_ids", "initial_state"):
      kw[name] = jnp.zeros(value)
    else:
      kw[name] = value
  arrays = [jnp.zeros(shapes[name]) for name in ("q", "k", "v", "g", "beta")]
  with pytest.raises(ValueError, match=re.escape(message)):
    recurrent.gated_delta_rule(*arrays, **kw)
