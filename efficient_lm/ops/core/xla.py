"""The blockwise online-softmax core on XLA: the `xla` backend, every platform.

Runs a `plan.Plan`: the banded schedule (each group of query blocks against
its band of key blocks, gathered by shifting whole blocks) or the looped
schedule (each query block over the key blocks its local pattern allows,
traced bounds, an online softmax). π's skips (one stride term, however many)
are one more piece beside the local part, merged by log-sum-exp
(`stride_attend`): a few skips (at most `SHIFT_SKIPS` landing in the call, a
static key offset) as one shifted view of the keys per skip distance, in the
call's layout; more as the row call: with the keys viewed as
`[T / period, period]`, query a * period + b sees rows a - skip_to ..
a - skip_from of column b, a window along the row axis, run by this core
batched over the columns. Explicit key positions (decoding caches) mask the
skips in the loop instead. Both schedules work heads-first (`[B, H, T, K]`;
"BTHK" calls are transposed once). The custom VJPs (one call, the local part
and its stride together, the stride piece alone) keep only q, k, v, the
priors, the document ids, o and lse; the backward recomputes the
probabilities block by block (the flash-attention backward) and handles a
cotangent on lse. Document ids add one comparison per block of logits,
broadcast over the heads.
Logits, softmax, lse and priors are float32; the q.k and p.v matmuls run in
the input dtype with float32 accumulation.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from efficient_lm.ops import precision
from efficient_lm.ops.core.call import Backend
from efficient_lm.ops.core.merge import merge
from efficient_lm.ops.core.plan import MASKED, NO_KEY_LSE, Plan, cdiv, is_static, plan_for
from efficient_lm.ops.pattern import Pattern

F32 = jnp.float32

# Slicing helpers: a window of an axis, zeros outside (static or traced start).

def _pad_axis(x: jax.Array, axis: int, before: int, after: int, value=0) -> jax.Array:
  pad = [(0, 0)] * x.ndim
  pad[axis] = (before, after)
  return jnp.pad(x, pad, constant_values=value)


def _window(x: jax.Array, start, size: int, axis: int = 2, value=0) -> jax.Array:
  """x[start:start + size] along `axis`, `value` where that is outside x."""
  n = x.shape[axis]
  if is_static(start):
    lo, hi = max(start, 0), min(start + size, n)
    if lo >= hi:
      shape = list(x.shape)
      shape[axis] = size
      return jnp.full(shape, value, x.dtype)
    piece = jax.lax.slice_in_dim(x, lo, hi, axis=axis)
    return _pad_axis(piece, axis, lo - start, start + size - hi, value)
  if size > n:  # x is the smaller: padded by `size` on both sides, any overlapping window fits
    padded = _pad_axis(x, axis, size, size, value)
    return jax.lax.dynamic_slice_in_dim(padded, start + size, size, axis=axis)
  # Only the window is copied, never all of x: the in-range slice nearest `start`, then shifted
  # (non-zero shift only at x's ends) with `value` filled in.
  inside = jnp.clip(start, 0, n - size)
  piece = _pad_axis(jax.lax.dynamic_slice_in_dim(x, inside, size, axis=axis), axis, size, size, value)
  return jax.lax.dynamic_slice_in_dim(piece, start - inside + size, size, axis=axis)


def _window_transpose(y: jax.Array, start, n: int, axis: int = 2) -> jax.Array:
  """The adjoint of `_window(x, start, y.shape[axis])` for an x of length n: y placed back at
  `start` (the zero-extended shift the other way)."""
  return _window(y, -start, n, axis)


def _slice(x: jax.Array, start, size: int, axis: int) -> jax.Array:
  if is_static(start):
    return jax.lax.slice_in_dim(x, start, start + size, axis=axis)
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _add_at(buf: jax.Array, start, update: jax.Array, axis: int = 2) -> jax.Array:
  """buf with `update` added at [start:start + len] along `axis` (in place under a loop)."""
  size = update.shape[axis]
  current = _slice(buf, start, size, axis)
  return jax.lax.dynamic_update_slice_in_dim(buf, current + update, start, axis=axis)


def _vma_zero(*xs) -> jax.Array:
  """A float32 scalar 0 varying over every mesh axis any of xs varies over: loop carries
  initialized from it match their bodies' types inside `shard_map`."""
  zero = jnp.zeros((), F32)
  for x in xs:
    if x is not None and not is_static(x):
      zero = zero + jnp.zeros_like(x, shape=(), dtype=F32)
  return zero


# The banded schedule, heads-first (`_forward` transposes "BTHK" calls): q, k, v are `[B, H, T, K]`
# (the sequence on axis T_AXIS), row quantities (lse, priors, delta) `[B, H, rows]`. Einsum letters:
# g groups' blocks, q queries, m band keys.

T_AXIS = 2
QK, PV, DKV = "bhgqk,bhgmk->bhgqm", "bhgqm,bhgmk->bhgqk", "bhgqm,bhgqk->bhgmk"


def _blocks(x: jax.Array, count: int, L: int) -> jax.Array:
  """`[B, H, count * L, ...]` -> `[B, H, count, L, ...]`."""
  return x.reshape(*x.shape[:T_AXIS], count, L, *x.shape[T_AXIS + 1:])


def _unblocks(x: jax.Array) -> jax.Array:
  return x.reshape(*x.shape[:T_AXIS], x.shape[T_AXIS] * x.shape[T_AXIS + 1], *x.shape[T_AXIS + 2:])


def _band_grid(plan: Plan, q_start, k_start):
  """(grid origin, query phase, key-window offset into k): ints when static, else traced."""
  qs = plan.q_start if plan.q_start is not None else q_start
  ks = plan.k_start if plan.k_start is not None else k_start
  phase = qs % plan.align if is_static(qs) else (qs % plan.align if plan.align > 1 else 0)
  origin = qs - phase
  return origin, phase, origin - plan.front - ks


def _band_key_positions(plan: Plan, origin, key_offset) -> jax.Array:
  """`[key_rows]` int32: each key row's position, -1 where the row is outside k."""
  e = jnp.arange(plan.key_rows, dtype=jnp.int32)
  index = key_offset + e
  pos = origin - plan.front + e
  return jnp.where((index >= 0) & (index < plan.Tk), pos, -1)


def _with_previous(x: jax.Array, count: int, extra: int, axis: int) -> jax.Array:
  """Blocks s..s+count-1 for s = 0..extra, concatenated along the block's row axis (axis + 1)."""
  parts = [jax.lax.slice_in_dim(x, s, s + count, axis=axis) for s in range(extra + 1)]
  return jnp.concatenate(parts, axis=axis + 1)


def _band_group(plan: Plan, g, q_grid, k_buf, v_buf, kpos_buf, origin, lp_grid, qseg_grid=None,
                kseg_buf=None):
  """One group's q slab, masked local logits `[B, H, G, L, M]` with the band's keys and values.
  With document ids (`qseg_grid` `[B, rows]`, `kseg_buf` `[B, key_rows]`) a key of another
  document is masked too."""
  t = T_AXIS
  L, G, nb = plan.block, plan.group, plan.back + plan.fwd
  B, H = q_grid.shape[:2]
  start = g * G * L
  q_g = _slice(q_grid, start, G * L, t)
  qpos = origin + start + jnp.arange(G * L, dtype=jnp.int32)
  band_start = start + plan.front - plan.back * L
  size = (G + nb) * L
  band = lambda buf: _with_previous(_blocks(_slice(buf, band_start, size, t), G + nb, L), G, nb, t)
  k_band, v_band = band(k_buf), band(v_buf)
  kpos_band = _with_previous(_slice(kpos_buf, band_start, size, 0).reshape(G + nb, L), G, nb, 0)
  local_GLM = plan.pattern.local_visible(qpos.reshape(G, L)[:, :, None], kpos_band[:, None, :])
  if qseg_grid is not None:
    qseg_BGL = _slice(qseg_grid, start, G * L, 1).reshape(B, G, L)
    kseg_BGM = _with_previous(_slice(kseg_buf, band_start, size, 1).reshape(B, G + nb, L), G, nb, 1)
    local_GLM = (local_GLM & (qseg_BGL[..., None] == kseg_BGM[:, :, None, :]))[:, None]
  s = precision.einsum_f32(QK, _blocks(q_g, G, L), k_band) * plan.scale
  if lp_grid is not None:
    s = s + _slice(lp_grid, start, G * L, 2).reshape(B, H, G, L)[..., None]
  s = jnp.where(local_GLM, s, MASKED)
  return q_g, s, k_band, v_band


def _band_inputs(plan: Plan, q, k, v, q_start, k_start, lp, qseg, kseg):
  origin, phase, key_offset = _band_grid(plan, q_start, k_start)
  rows = plan.groups * plan.group * plan.block
  q_grid = _window(q, -phase, rows)
  k_buf = _window(k, key_offset, plan.key_rows)
  v_buf = _window(v, key_offset, plan.key_rows)
  kpos_buf = _band_key_positions(plan, origin, key_offset)
  lp_grid = None if lp is None else _window(lp, -phase, rows)
  segs = (None, None)
  if qseg is not None:
    segs = (_window(qseg, -phase, rows, axis=1),
            _window(kseg, key_offset, plan.key_rows, axis=1, value=-1))
  return origin, phase, key_offset, q_grid, k_buf, v_buf, kpos_buf, lp_grid, segs


def _groups_loop(plan: Plan, body, carry):
  """body(g, carry) over the groups: a fori_loop, or one static call for a single group."""
  if plan.groups == 1:
    return body(0, carry)
  return jax.lax.fori_loop(0, plan.groups, body, carry)


def _band_forward(plan: Plan, q, k, v, q_start, k_start, lp, sp, qseg, kseg):
  origin, phase, _, q_grid, k_buf, v_buf, kpos_buf, lp_grid, segs = _band_inputs(
      plan, q, k, v, q_start, k_start, lp, qseg, kseg)
  B, H, rows, Kv = *q_grid.shape[:3], v.shape[-1]
  L, G = plan.block, plan.group

  def body(g, carry):
    o_grid, lse_grid = carry
    _, s, _, v_band = _band_group(plan, g, q_grid, k_buf, v_buf, kpos_buf, origin, lp_grid, *segs)
    m = jnp.maximum(jnp.max(s, axis=-1).reshape(B, H, G * L), NO_KEY_LSE)
    p = jnp.exp(s - m.reshape(B, H, G, L)[..., None])
    l = jnp.sum(p, axis=-1).reshape(B, H, G * L)
    acc = _unblocks(precision.einsum_f32(PV, p.astype(v.dtype), v_band))
    safe_l = jnp.where(l > 0, l, 1.0)
    o = (acc / safe_l[..., None]).astype(q.dtype)
    lse = jnp.where(l > 0, m + jnp.log(safe_l), NO_KEY_LSE)
    start = g * G * L
    return (jax.lax.dynamic_update_slice_in_dim(o_grid, o, start, axis=T_AXIS),
            jax.lax.dynamic_update_slice_in_dim(lse_grid, lse, start, axis=2))

  zero = _vma_zero(q, k, v, q_start, k_start, lp, sp, qseg, kseg)
  o_shape = list(q_grid.shape[:3]) + [Kv]
  init = (jnp.zeros(o_shape, q.dtype) + zero.astype(q.dtype), jnp.zeros((B, H, rows), F32) + zero)
  o_grid, lse_grid = _groups_loop(plan, body, init)
  return _window(o_grid, phase, plan.Tq), _window(lse_grid, phase, plan.Tq)


def _scatter_band(x: jax.Array, G: int, nb: int, L: int) -> jax.Array:
  """The adjoint of `_with_previous` on a band gradient (blocks on the sequence axis, the band
  after it): the slab gradient, (G + nb) L long."""
  t = T_AXIS
  out = 0.0
  for s in range(nb + 1):
    out = out + _pad_axis(jax.lax.slice_in_dim(x, s * L, (s + 1) * L, axis=t + 1), t, s, nb - s)
  return _unblocks(out)


def _band_backward(plan: Plan, q, k, v, q_start, k_start, lp, sp, qseg, kseg, o, lse, do, dlse):
  origin, phase, key_offset, q_grid, k_buf, v_buf, kpos_buf, lp_grid, segs = _band_inputs(
      plan, q, k, v, q_start, k_start, lp, qseg, kseg)
  t = T_AXIS
  B, H, rows = q_grid.shape[:3]
  L, G, nb = plan.block, plan.group, plan.back + plan.fwd
  do_grid = _window(do, -phase, rows)
  lse_grid = _window(lse, -phase, rows)
  delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1) - dlse
  delta_grid = _window(delta, -phase, rows)

  def body(g, carry):
    dq_grid, dlp_grid, dk_buf, dv_buf = carry
    q_g, s, k_band, v_band = _band_group(plan, g, q_grid, k_buf, v_buf, kpos_buf, origin,
                                         lp_grid, *segs)
    start = g * G * L
    lse_g = _slice(lse_grid, start, G * L, 2)
    delta_g = _slice(delta_grid, start, G * L, 2)
    do_g = _slice(do_grid, start, G * L, t)
    do_blk, q_blk = _blocks(do_g, G, L), _blocks(q_g, G, L)
    p = jnp.exp(s - lse_g.reshape(B, H, G, L)[..., None])
    dp = precision.einsum_f32(QK, do_blk, v_band)
    ds = p * (dp - delta_g.reshape(B, H, G, L)[..., None])
    dq = _unblocks(precision.einsum_f32(PV, ds.astype(k.dtype), k_band))
    dk_band = precision.einsum_f32(DKV, ds.astype(q.dtype), q_blk)
    dv_band = precision.einsum_f32(DKV, p.astype(do.dtype), do_blk)
    band_start = start + plan.front - plan.back * L
    dk_buf = _add_at(dk_buf, band_start, plan.scale * _scatter_band(dk_band, G, nb, L), t)
    dv_buf = _add_at(dv_buf, band_start, _scatter_band(dv_band, G, nb, L), t)
    if lp_grid is not None:
      dlp_grid = jax.lax.dynamic_update_slice_in_dim(
          dlp_grid, jnp.sum(ds, axis=-1).reshape(B, H, G * L), start, axis=2)
    dq_grid = jax.lax.dynamic_update_slice_in_dim(dq_grid, dq * plan.scale, start, axis=t)
    return dq_grid, dlp_grid, dk_buf, dv_buf

  zero = _vma_zero(q, k, v, q_start, k_start, lp, sp, qseg, kseg, do, dlse)
  zeros_rows = jnp.zeros((B, H, rows), F32) + zero
  buf_shape = lambda x, n: tuple(n if a == t else d for a, d in enumerate(x.shape))
  init = (jnp.zeros(buf_shape(q, rows), F32) + zero, zeros_rows if lp is not None else None,
          jnp.zeros(buf_shape(k, plan.key_rows), F32) + zero,
          jnp.zeros(buf_shape(v, plan.key_rows), F32) + zero)
  dq_grid, dlp_grid, dk_buf, dv_buf = _groups_loop(plan, body, init)
  dq = _window(dq_grid, phase, plan.Tq).astype(q.dtype)
  dk = _window_transpose(dk_buf, key_offset, plan.Tk).astype(k.dtype)
  dv = _window_transpose(dv_buf, key_offset, plan.Tk).astype(v.dtype)
  dlp = None if lp is None else _window(dlp_grid, phase, plan.Tq)
  dsp = None if sp is None else jnp.zeros_like(sp)  # a band plan has no skip keys
  return dq, dk, dv, dlp, dsp


# The looped schedule.

def _loop_inputs(plan: Plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg):
  Lq, Lk = plan.q_block, plan.k_block
  NQ, NK = cdiv(plan.Tq, Lq), cdiv(plan.Tk, Lk)
  qs = plan.q_start if plan.q_start is not None else q_start
  ks = plan.k_start if plan.k_start is not None else k_start
  q_buf = _window(q, 0, NQ * Lq)
  k_buf = _window(k, 0, NK * Lk)
  v_buf = _window(v, 0, NK * Lk)
  if plan.explicit:
    kpos_buf = _window(k_pos.astype(jnp.int32), 0, NK * Lk, axis=0, value=-1)
  else:
    index = jnp.arange(NK * Lk, dtype=jnp.int32)
    kpos_buf = jnp.where(index < plan.Tk, ks + index, -1)
  qpos_buf = qs + jnp.arange(NQ * Lq, dtype=jnp.int32)
  lp_buf = None if lp is None else _window(lp, 0, NQ * Lq)
  sp_buf = None if sp is None else _window(sp, 0, NQ * Lq)
  segs = (None, None)
  if qseg is not None:
    segs = (_window(qseg, 0, NQ * Lq, axis=1), _window(kseg, 0, NK * Lk, axis=1, value=-1))
  return qs, ks, NQ, NK, q_buf, k_buf, v_buf, kpos_buf, qpos_buf, lp_buf, sp_buf, segs


def _key_blocks(plan: Plan, qs, ks, i, NK: int):
  """[first, last) key blocks query block i may see: from `pattern.key_range` (all for explicit).

  Python ints when every input is static (then a block that sees nothing is skipped at trace
  time), traced scalars otherwise."""
  if plan.explicit:
    return 0, NK
  pattern = plan.pattern
  Lq, Lk = plan.q_block, plan.k_block
  first = qs + i * Lq
  static = all(is_static(x) for x in (first, ks))
  if static:
    last = min(first + Lq - 1, qs + plan.Tq - 1)
    lo, hi = pattern.key_range(first, last)
    lo_blk = min(max((lo - ks) // Lk, 0), NK)
    hi_blk = NK if hi is None else min(max((hi - ks) // Lk + 1, 0), NK)
    return lo_blk, max(hi_blk, lo_blk)
  last = jnp.minimum(first + Lq - 1, qs + plan.Tq - 1)
  lo, hi = pattern.key_range(first, last)
  lo_blk = jnp.clip(jnp.floor_divide(lo - ks, Lk), 0, NK)
  hi_blk = NK if hi is None else jnp.clip(jnp.floor_divide(hi - ks, Lk) + 1, 0, NK)
  return lo_blk, jnp.maximum(hi_blk, lo_blk)


def _block_logits(plan: Plan, q_i, qpos_i, k_j, kpos_j, lp_i, sp_i, qseg_i=None, kseg_j=None):
  """Masked logits `[B, H, Lq, Lk]` of one block pair, and its local / skip masks (`[Lq, Lk]`, or
  `[B, 1, Lq, Lk]` with document ids `qseg_i` `[B, Lq]`, `kseg_j` `[B, Lk]`)."""
  s = precision.einsum_f32("bhqk,bhsk->bhqs", q_i, k_j) * plan.scale
  local = plan.pattern.local_visible(qpos_i[:, None], kpos_j[None, :])
  same = None if qseg_i is None else (qseg_i[:, :, None] == kseg_j[:, None, :])[:, None]
  if same is not None:
    local = local & same
  s_local = s if lp_i is None else s + lp_i[..., None]
  if not plan.pattern.has_skips:
    return jnp.where(local, s_local, MASKED), local, None
  skip = plan.pattern.skip_visible(qpos_i[:, None], kpos_j[None, :])
  if same is not None:
    skip = skip & same
  s_skip = s if sp_i is None else s + sp_i[..., None]
  return jnp.where(local, s_local, jnp.where(skip, s_skip, MASKED)), local, skip


def _loop_over(lo, hi, NK: int, body, carry):
  """body(j, carry) for key blocks j in [lo, hi): a loop, or one guarded call for one block."""
  if NK == 1:
    if is_static(lo) and is_static(hi):
      return body(0, carry) if lo < hi else carry
    return jax.lax.cond(lo < hi, lambda c: body(0, c), lambda c: c, carry)
  return jax.lax.fori_loop(lo, hi, body, carry)


def _q_loop(NQ: int, body, carry):
  if NQ == 1:
    return body(0, carry)
  return jax.lax.fori_loop(0, NQ, body, carry)


def _loop_forward(plan: Plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg):
  qs, ks, NQ, NK, q_buf, k_buf, v_buf, kpos_buf, qpos_buf, lp_buf, sp_buf, segs = _loop_inputs(
      plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg)
  qseg_buf, kseg_buf = segs
  B, H, _, _ = q_buf.shape
  Kv = v.shape[-1]
  Lq, Lk = plan.q_block, plan.k_block
  zero = _vma_zero(q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg)

  def q_body(i, carry):
    o_buf, lse_buf = carry
    q_i = _slice(q_buf, i * Lq, Lq, 2)
    qpos_i = _slice(qpos_buf, i * Lq, Lq, 0)
    lp_i = None if lp_buf is None else _slice(lp_buf, i * Lq, Lq, 2)
    sp_i = None if sp_buf is None else _slice(sp_buf, i * Lq, Lq, 2)
    qseg_i = None if qseg_buf is None else _slice(qseg_buf, i * Lq, Lq, 1)

    def k_body(j, state):
      m, l, acc = state
      k_j = k_buf if NK == 1 else _slice(k_buf, j * Lk, Lk, 2)
      v_j = v_buf if NK == 1 else _slice(v_buf, j * Lk, Lk, 2)
      kpos_j = kpos_buf if NK == 1 else _slice(kpos_buf, j * Lk, Lk, 0)
      kseg_j = _key_segments(kseg_buf, j, Lk, NK)
      s, _, _ = _block_logits(plan, q_i, qpos_i, k_j, kpos_j, lp_i, sp_i, qseg_i, kseg_j)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      correction = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new[..., None])
      l = l * correction + jnp.sum(p, axis=-1)
      acc = acc * correction[..., None] + precision.einsum_f32(
          "bhqs,bhsk->bhqk", p.astype(v.dtype), v_j)
      return m_new, l, acc

    lo, hi = _key_blocks(plan, qs, ks, i, NK)
    state = (jnp.full((B, H, Lq), NO_KEY_LSE, F32) + zero, jnp.zeros((B, H, Lq), F32) + zero,
             jnp.zeros((B, H, Lq, Kv), F32) + zero)
    m, l, acc = _loop_over(lo, hi, NK, k_body, state)
    o = (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(q.dtype)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), NO_KEY_LSE)
    if NQ == 1:
      return o, lse
    return (jax.lax.dynamic_update_slice_in_dim(o_buf, o, i * Lq, axis=2),
            jax.lax.dynamic_update_slice_in_dim(lse_buf, lse, i * Lq, axis=2))

  init = (None, None) if NQ == 1 else (jnp.zeros((B, H, NQ * Lq, Kv), q.dtype) + zero.astype(q.dtype),
                                       jnp.zeros((B, H, NQ * Lq), F32) + zero)
  o_buf, lse_buf = _q_loop(NQ, q_body, init)
  if NQ * Lq == plan.Tq:
    return o_buf, lse_buf
  return o_buf[:, :, :plan.Tq], lse_buf[:, :, :plan.Tq]


def _loop_backward(plan: Plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg, o, lse, do,
                   dlse):
  qs, ks, NQ, NK, q_buf, k_buf, v_buf, kpos_buf, qpos_buf, lp_buf, sp_buf, segs = _loop_inputs(
      plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg)
  qseg_buf, kseg_buf = segs
  B, H, _, K = q_buf.shape
  Lq, Lk = plan.q_block, plan.k_block
  rows = NQ * Lq
  zero = _vma_zero(q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg, do, dlse)
  do_buf = _window(do, 0, rows)
  lse_buf = _window(lse, 0, rows)
  delta_buf = _window(jnp.sum(do.astype(F32) * o.astype(F32), axis=-1) - dlse, 0, rows)

  def q_body(i, carry):
    dq_buf, dlp_buf, dsp_buf, dk_buf, dv_buf = carry
    q_i = _slice(q_buf, i * Lq, Lq, 2)
    qpos_i = _slice(qpos_buf, i * Lq, Lq, 0)
    do_i = _slice(do_buf, i * Lq, Lq, 2)
    lse_i = _slice(lse_buf, i * Lq, Lq, 2)
    delta_i = _slice(delta_buf, i * Lq, Lq, 2)
    lp_i = None if lp_buf is None else _slice(lp_buf, i * Lq, Lq, 2)
    sp_i = None if sp_buf is None else _slice(sp_buf, i * Lq, Lq, 2)
    qseg_i = None if qseg_buf is None else _slice(qseg_buf, i * Lq, Lq, 1)

    def k_body(j, state):
      dq_i, dlp_i, dsp_i, dk_buf, dv_buf = state
      k_j = k_buf if NK == 1 else _slice(k_buf, j * Lk, Lk, 2)
      v_j = v_buf if NK == 1 else _slice(v_buf, j * Lk, Lk, 2)
      kpos_j = kpos_buf if NK == 1 else _slice(kpos_buf, j * Lk, Lk, 0)
      kseg_j = _key_segments(kseg_buf, j, Lk, NK)
      s, local, skip = _block_logits(plan, q_i, qpos_i, k_j, kpos_j, lp_i, sp_i, qseg_i, kseg_j)
      p = jnp.exp(s - lse_i[..., None])
      dp = precision.einsum_f32("bhqk,bhsk->bhqs", do_i, v_j)
      ds = p * (dp - delta_i[..., None])
      dq_i = dq_i + precision.einsum_f32("bhqs,bhsk->bhqk", ds.astype(k.dtype), k_j)
      dk_j = precision.einsum_f32("bhqs,bhqk->bhsk", ds.astype(q.dtype), q_i)
      dv_j = precision.einsum_f32("bhqs,bhqk->bhsk", p.astype(do.dtype), do_i)
      dk_buf = _add_at(dk_buf, j * Lk, plan.scale * dk_j)
      dv_buf = _add_at(dv_buf, j * Lk, dv_j)
      if dlp_i is not None:
        dlp_i = dlp_i + jnp.sum(ds if skip is None else jnp.where(local, ds, 0.0), axis=-1)
      if dsp_i is not None:
        dsp_i = dsp_i + jnp.sum(jnp.where(skip, ds, 0.0), axis=-1)
      return dq_i, dlp_i, dsp_i, dk_buf, dv_buf

    lo, hi = _key_blocks(plan, qs, ks, i, NK)
    zero_rows = jnp.zeros((B, H, Lq), F32) + zero
    state = (jnp.zeros((B, H, Lq, K), F32) + zero, None if lp is None else zero_rows,
             None if sp is None or _skip_free(plan) else zero_rows, dk_buf, dv_buf)
    dq_i, dlp_i, dsp_i, dk_buf, dv_buf = _loop_over(lo, hi, NK, k_body, state)
    put = lambda buf, x: None if buf is None else jax.lax.dynamic_update_slice_in_dim(
        buf, x, i * Lq, axis=2)
    return put(dq_buf, dq_i), put(dlp_buf, dlp_i), put(dsp_buf, dsp_i), dk_buf, dv_buf

  zero_rows = jnp.zeros((B, H, rows), F32) + zero
  init = (jnp.zeros((B, H, rows, K), F32) + zero, None if lp is None else zero_rows,
          None if sp is None or _skip_free(plan) else zero_rows,
          jnp.zeros((B, H, NK * Lk, K), F32) + zero,
          jnp.zeros((B, H, NK * Lk, v.shape[-1]), F32) + zero)
  dq_buf, dlp_buf, dsp_buf, dk_buf, dv_buf = _q_loop(NQ, q_body, init)
  dq = (dq_buf[:, :, :plan.Tq] * plan.scale).astype(q.dtype)
  dk, dv = dk_buf[:, :, :plan.Tk], dv_buf[:, :, :plan.Tk]
  dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
  dlp = None if lp is None else dlp_buf[:, :, :plan.Tq]
  dsp = None if sp is None else (jnp.zeros_like(sp) if dsp_buf is None else dsp_buf[:, :, :plan.Tq])
  return dq, dk, dv, dlp, dsp


def _skip_free(plan: Plan) -> bool:
  return not plan.pattern.has_skips


def _key_segments(kseg_buf, j, Lk: int, NK: int):
  if kseg_buf is None:
    return None
  return kseg_buf if NK == 1 else _slice(kseg_buf, j * Lk, Lk, 1)


# The custom VJP: residuals q, k, v, (starts, key positions), priors, o, lse.

def _forward(plan: Plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg):
  """(o in the plan's layout, lse `[B, H, Tq]`). Both schedules work heads-first: "BTHK" arrays
  are transposed here (O(T); measured faster on CPU than einsums over BTHK slabs)."""
  if plan.layout == "BTHK":
    o, lse = _forward(dataclasses.replace(plan, layout="BHTK"), *_swap(q, k, v), q_start, k_start,
                      k_pos, lp, sp, qseg, kseg)
    return jnp.swapaxes(o, 1, 2), lse
  if plan.schedule == "band":
    return _band_forward(plan, q, k, v, q_start, k_start, lp, sp, qseg, kseg)
  return _loop_forward(plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg)


def _backward(plan: Plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg, o, lse, do, dlse):
  if plan.layout == "BTHK":
    q_, k_, v_, o_, do_ = _swap(q, k, v, o, do)
    grads = _backward(dataclasses.replace(plan, layout="BHTK"), q_, k_, v_, q_start, k_start,
                      k_pos, lp, sp, qseg, kseg, o_, lse, do_, dlse)
    return (*_swap(*grads[:3]), *grads[3:])
  if plan.schedule == "band":
    return _band_backward(plan, q, k, v, q_start, k_start, lp, sp, qseg, kseg, o, lse, do, dlse)
  return _loop_backward(plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg, o, lse, do,
                        dlse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg):
  return _forward(plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg)


def _attend_fwd(plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg):
  o, lse = _forward(plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg)
  return (o, lse), (q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg, o, lse)


def _attend_bwd(plan, residuals, cotangents):
  q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg, o, lse = residuals
  do, dlse = cotangents
  dlse = dlse.astype(F32)
  dq, dk, dv, dlp, dsp = _backward(plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg, o,
                                   lse, do, dlse)
  return dq, dk, dv, None, None, None, dlp, dsp, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _swap(*xs):
  """BTHK <-> BHTK (axes 1 and 2) for every array given (None stays None)."""
  return tuple(None if x is None else jnp.swapaxes(x, 1, 2) for x in xs)


def _arg(start, static):
  return None if static is not None else jnp.asarray(start, jnp.int32)


def _args(plan: Plan, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior, qseg, kseg):
  """`_attend`'s arguments: traced starts only where the plan has no static one; priors float32
  heads-first (`[B, H, Tq]`)."""
  if plan.layout == "BTHK":
    local_prior, skip_prior = _swap(local_prior, skip_prior)
  priors = (None if p is None else p.astype(F32) for p in (local_prior, skip_prior))
  return (q, k, v, _arg(q_start, plan.q_start), _arg(k_start, plan.k_start), k_positions, *priors,
          qseg, kseg)


def attend(plan: Plan, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior,
           q_segments=None, k_segments=None):
  """(o in the plan's layout, lse in the priors' layout: `[B, Tq, H]` for "BTHK")."""
  o, lse = _attend(plan, *_args(plan, q, k, v, q_start, k_start, k_positions, local_prior,
                                skip_prior, q_segments, k_segments))
  return o, (jnp.swapaxes(lse, 1, 2) if plan.layout == "BTHK" else lse)


def attend_backward(plan: Plan, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior,
                    q_segments, k_segments, o, lse, do, dlse):
  """(dq, dk, dv, d local_prior, d skip_prior) of one call at the given o and lse (lse and dlse
  in the priors' layout)."""
  if plan.layout == "BTHK":
    lse, dlse = _swap(lse, dlse)
  residuals = (*_args(plan, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior,
                      q_segments, k_segments), o, lse.astype(F32))
  dq, dk, dv, _, _, _, dlp, dsp, _, _ = _attend_bwd(plan, residuals, (do, dlse))
  if plan.layout == "BTHK":
    dlp, dsp = _swap(dlp, dsp)
  return dq, dk, dv, dlp, dsp


# π's stride: the skip keys of every query as one call of the core over the period's columns.

_NO_DOCUMENT = jnp.iinfo(jnp.int32).min  # the document id of a key the stride must not see


@dataclasses.dataclass(frozen=True)
class _Stride:
  """The static geometry of a call's stride piece. Positions u are relative to the first query
  (a key at index j sits at u = j + k_offset); query u = a * period + b is row a, column b of
  `[rows, period]`, and the key grid's row r holds u = (r - front) * period + b. Query row a sees
  key rows r with a - r + front in [skip_from, skip_to]: in the row call, query row a sits at
  position a + front and key row r at r + skip_from, under `pattern` (a window of
  skip_to - skip_from + 1 rows, or causal for skips back to the start)."""
  period: int
  rows: int          # query rows: cdiv(Tq, period)
  front: int         # key rows before query row 0
  key_rows: int
  pattern: Pattern
  masked: bool       # some row sees a grid key that is not a key (or before the sequence start)
  plan: Plan


def _stride_of(call) -> _Stride | None:
  """The stride piece's geometry (None when no query can see a skip key). A traced key offset
  needs a bounded stride (the grid then reaches skip_to rows back, the keys' place unknown)."""
  pattern, P = call.pattern, call.pattern.period
  first, last = pattern.skip_from, pattern.skip_to
  ko = call.k_offset
  rows = cdiv(call.Tq, P)
  if ko is None:
    front = last
  else:
    front = max(0, cdiv(-ko, P)) if last is None else min(max(0, cdiv(-ko, P)), last)
  key_rows = front + rows - first
  if key_rows <= 0:
    return None
  reach_rows = front + rows - 1  # the farthest a query row looks back, in rows
  if last is None or last >= reach_rows:
    rows_pattern = Pattern.dense()
  else:
    rows_pattern = Pattern.sliding(last - first + 1)
  # Keys the real queries can reach on the grid (from -front P), against those that exist.
  masked = True
  if call.q_start is not None and ko is not None:
    masked = (-front * P < max(ko, -call.q_start) or call.Tq - 1 - first * P >= ko + call.Tk)
  plan = plan_for(rows_pattern, rows, key_rows, q_start=front, k_start=first, scale=call.scale,
                  layout="BHTK")
  return _Stride(period=P, rows=rows, front=front, key_rows=key_rows, pattern=rows_pattern,
                 masked=masked, plan=plan)


def _column_perm(ndim: int, axis: int, heads: bool) -> tuple[int, ...]:
  """The transpose from x reshaped to `[.., rows, P, ..]` (rows at `axis`) to `[B, P, H, rows, ..]`
  (`heads`: x has a heads axis beside the sequence, "BTHK" or "BHTK") or `[B, P, rows]`."""
  if not heads:
    return (0, 2, 1)
  if axis == 1:  # [B, rows, P, H, (K)]
    return (0, 2, 3, 1, *range(4, ndim))
  return (0, 3, 1, 2, *range(4, ndim))  # [B, H, rows, P, (K)]


def _to_columns(x: jax.Array, start, rows: int, P: int, axis: int, value=0) -> jax.Array:
  """x[start : start + rows P] along `axis` (`value` outside x) as the period's columns batched,
  heads-first: `[B P, H, rows, ...]` (`[B P, rows]` for document ids `[B, T]`)."""
  w = _window(x, start, rows * P, axis=axis, value=value)
  w = w.reshape(*w.shape[:axis], rows, P, *w.shape[axis + 1:])
  w = jnp.transpose(w, _column_perm(w.ndim, axis, x.ndim > 2))
  return w.reshape(w.shape[0] * P, *w.shape[2:])


def _from_columns(y: jax.Array, P: int, axis: int) -> jax.Array:
  """The inverse of `_to_columns`' reshaping: `[B P, H, rows, ...]` -> x's layout, rows P long
  (the sequence at `axis`)."""
  y = y.reshape(y.shape[0] // P, P, *y.shape[1:])
  perm = _column_perm(y.ndim, axis, True)
  y = jnp.transpose(y, [perm.index(a) for a in range(y.ndim)])
  return y.reshape(*y.shape[:axis], y.shape[axis] * P, *y.shape[axis + 2:])


def _key_offset(call, q_start, k_start):
  """k_start - q_start: static when the call's is, else traced."""
  if call.k_offset is not None:
    return call.k_offset
  return jnp.asarray(k_start, jnp.int32) - jnp.asarray(q_start, jnp.int32)


def _stride_inputs(call, geo: _Stride, q, k, v, q_start, ko, skip_prior, q_segments, k_segments):
  """The row call's q, k, v, prior and document ids (columns batched); ko = k_start - q_start."""
  t = 1 if call.layout == "BTHK" else 2
  P, rows, key_rows = geo.period, geo.rows, geo.key_rows
  k_first = -geo.front * P - ko  # the key index of the grid's first slot
  cols = lambda x, start, n, axis=t, value=0: _to_columns(x, start, n, P, axis, value)
  q_c, k_c, v_c = cols(q, 0, rows), cols(k, k_first, key_rows), cols(v, k_first, key_rows)
  sp_c = None if skip_prior is None else cols(skip_prior.astype(F32), 0, rows)
  segs = (None, None)
  if geo.masked or q_segments is not None:
    B, Tk = k.shape[0], call.Tk
    kseg = (jnp.zeros((B, Tk), jnp.int32) if k_segments is None else k_segments.astype(jnp.int32))
    u = jnp.arange(Tk, dtype=jnp.int32) + ko
    kseg = jnp.where((jnp.asarray(q_start, jnp.int32) + u >= 0)[None], kseg, _NO_DOCUMENT)
    qseg = (jnp.zeros((B, call.Tq), jnp.int32) if q_segments is None
            else q_segments.astype(jnp.int32))
    segs = (cols(qseg, 0, rows, 1), cols(kseg, k_first, key_rows, 1, _NO_DOCUMENT))
  return q_c, k_c, v_c, sp_c, segs


def _no_keys(call, q, v):
  """(o, lse) of rows that see no key."""
  return (jnp.zeros((*q.shape[:3], v.shape[-1]), q.dtype), jnp.full(q.shape[:3], NO_KEY_LSE, F32))


def _rows_forward(call, geo: _Stride, q, k, v, q_start, k_start, skip_prior, q_segments,
                  k_segments):
  """(o, lse) of the stride as the row call: one call of this core over the period's columns."""
  t = 1 if call.layout == "BTHK" else 2
  ko = _key_offset(call, q_start, k_start)
  q_c, k_c, v_c, sp_c, segs = _stride_inputs(call, geo, q, k, v, q_start, ko, skip_prior,
                                             q_segments, k_segments)
  o_c, lse_c = attend(geo.plan, q_c, k_c, v_c, geo.front, call.pattern.skip_from, None, sp_c, None,
                      *segs)
  o = _window(_from_columns(o_c, geo.period, t), 0, call.Tq, axis=t)
  return o, _window(_from_columns(lse_c, geo.period, t), 0, call.Tq, axis=t)


def _rows_backward(call, geo: _Stride, q, k, v, q_start, k_start, skip_prior, q_segments,
                   k_segments, o, lse, do, dlse):
  """(dq, dk, dv, d skip_prior) of the row call at the given o and lse."""
  t = 1 if call.layout == "BTHK" else 2
  P, rows = geo.period, geo.rows
  ko = _key_offset(call, q_start, k_start)
  q_c, k_c, v_c, sp_c, segs = _stride_inputs(call, geo, q, k, v, q_start, ko, skip_prior,
                                             q_segments, k_segments)
  o_c, lse_c, do_c, dlse_c = (_to_columns(x, 0, rows, P, t) for x in (o, lse, do, dlse))
  dq_c, dk_c, dv_c, dsp_c, _ = attend_backward(geo.plan, q_c, k_c, v_c, geo.front,
                                               call.pattern.skip_from, None, sp_c, None, *segs,
                                               o_c, lse_c, do_c, dlse_c)
  k_first = -geo.front * P - ko
  back = lambda y, start, n: _window(_from_columns(y, P, t), start, n, axis=t)
  dq = back(dq_c, 0, call.Tq)
  dk, dv = back(dk_c, -k_first, call.Tk), back(dv_c, -k_first, call.Tk)
  dsp = None if skip_prior is None else back(dsp_c, 0, call.Tq)
  return dq, dk, dv, dsp


# A few skips: one shifted view of the keys per skip distance, in the call's layout.

# A stride with at most this many skips landing in the call runs as shifts. Measured on a loaded
# 2-core CPU (experiments/results/stride_ways.json: π at T = 2,048, window 128, period 128, forward +
# backward, side by side): shifts took 0.94x the row call's time with 3 skips, 0.97x with 4 (1.02x
# in an earlier run), 1.06x with 5, 1.33x with 8.
SHIFT_SKIPS = 3


def _shift_skips(call) -> tuple[int, ...] | None:
  """The multiples m whose skip keys (m periods back) some query of the call can reach, when the
  stride runs as shifts: with a static key offset and at most SHIFT_SKIPS of them (the program
  then grows with their count, bounded by SHIFT_SKIPS); None: the row call (`_Stride`)."""
  ko, pattern = call.k_offset, call.pattern
  if ko is None:
    return None
  P = pattern.period
  hi = (call.Tq - 1 - ko) // P  # some query's key index i - m P - ko is >= 0 ...
  if pattern.skip_to is not None:
    hi = min(hi, pattern.skip_to)
  if call.q_start is not None:
    hi = min(hi, (call.q_start + call.Tq - 1) // P)  # a key position >= 0
  lo = max(pattern.skip_from, (-ko - call.Tk) // P + 1)  # ... and below Tk
  if hi - lo + 1 > SHIFT_SKIPS:
    return None
  return tuple(range(lo, hi + 1))


def _shift_logits(call, ms, q, k, q_start, skip_prior, q_segments, k_segments) -> list:
  """For each m of `ms`: the logits `q.shape[:3]` of every query against its key m periods back
  (a shifted view of k), the skip prior added, MASKED where that key is absent."""
  t = 1 if call.layout == "BTHK" else 2
  on_rows = (lambda x: x[:, :, None]) if t == 1 else (lambda x: x[:, None, :])  # [B, Tq] -> rows
  i = jnp.arange(call.Tq, dtype=jnp.int32)
  logits = []
  for m in ms:
    offset = -(m * call.pattern.period + call.k_offset)  # query i's key sits at index i + offset
    s = precision.einsum_f32("bthk,bthk->bth", q, _window(k, offset, call.Tq, axis=t)) * call.scale
    if skip_prior is not None:
      s = s + skip_prior.astype(F32)
    seen = ((i + offset >= 0) & (i + offset < call.Tk)
            & (jnp.asarray(q_start, jnp.int32) + i - m * call.pattern.period >= 0))[None]
    if q_segments is not None:
      seen = seen & (q_segments == _window(k_segments, offset, call.Tq, axis=1,
                                           value=_NO_DOCUMENT))
    logits.append(jnp.where(on_rows(seen), s, MASKED))
  return logits


def _shift_forward(call, ms, q, k, v, q_start, skip_prior, q_segments, k_segments):
  """(o, lse) of the stride's keys at the shifts `ms` (one softmax over them)."""
  t = 1 if call.layout == "BTHK" else 2
  logits = _shift_logits(call, ms, q, k, q_start, skip_prior, q_segments, k_segments)
  peak = jnp.maximum(functools.reduce(jnp.maximum, logits), NO_KEY_LSE)
  p = [jnp.exp(s - peak) for s in logits]
  l = functools.reduce(jnp.add, p)
  acc = functools.reduce(jnp.add, [
      p_m[..., None] * _window(v, -(m * call.pattern.period + call.k_offset), call.Tq,
                               axis=t).astype(F32) for m, p_m in zip(ms, p)])
  safe = jnp.where(l > 0, l, 1.0)
  return ((acc / safe[..., None]).astype(q.dtype),
          jnp.where(l > 0, peak + jnp.log(safe), NO_KEY_LSE))


def _shift_backward(call, ms, q, k, v, q_start, skip_prior, q_segments, k_segments, o, lse, do,
                    dlse):
  """(dq, dk, dv, d skip_prior) of the shifts at the given o and lse (the flash backward)."""
  t = 1 if call.layout == "BTHK" else 2
  logits = _shift_logits(call, ms, q, k, q_start, skip_prior, q_segments, k_segments)
  delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1) - dlse
  dq = dk = dv = dsp = 0.0
  for m, s in zip(ms, logits):
    offset = -(m * call.pattern.period + call.k_offset)
    k_m, v_m = (_window(x, offset, call.Tq, axis=t) for x in (k, v))
    p = jnp.exp(s - lse)
    ds = p * (precision.einsum_f32("bthk,bthk->bth", do, v_m) - delta)
    dq = dq + ds[..., None] * k_m.astype(F32)
    dk = dk + _window(ds[..., None] * q.astype(F32), -offset, call.Tk, axis=t)
    dv = dv + _window(p[..., None] * do.astype(F32), -offset, call.Tk, axis=t)
    dsp = dsp + ds
  return ((dq * call.scale).astype(q.dtype), (dk * call.scale).astype(k.dtype), dv.astype(v.dtype),
          None if skip_prior is None else dsp)


# The stride piece: the shifts for a few skips (`_shift_skips`), else the row call.

def _stride_forward(call, q, k, v, q_start, k_start, skip_prior, q_segments, k_segments):
  ms = _shift_skips(call)
  if ms is not None:
    if not ms:
      return _no_keys(call, q, v)
    return _shift_forward(call, ms, q, k, v, q_start, skip_prior, q_segments, k_segments)
  geo = _stride_of(call)
  if geo is None:
    return _no_keys(call, q, v)
  return _rows_forward(call, geo, q, k, v, q_start, k_start, skip_prior, q_segments, k_segments)


def _stride_backward(call, q, k, v, q_start, k_start, skip_prior, q_segments, k_segments, o, lse,
                     do, dlse):
  """(dq, dk, dv, d skip_prior) of the stride piece at the given o and lse (those of the union)."""
  ms = _shift_skips(call)
  geo = None if ms is not None else _stride_of(call)
  if not ms and geo is None:
    return (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v),
            None if skip_prior is None else jnp.zeros_like(skip_prior))
  if ms:
    return _shift_backward(call, ms, q, k, v, q_start, skip_prior, q_segments, k_segments, o, lse,
                           do, dlse)
  return _rows_backward(call, geo, q, k, v, q_start, k_start, skip_prior, q_segments, k_segments,
                        o, lse, do, dlse)


def stride_attend(call, q, k, v, q_start, skip_prior=None, q_segments=None, k_segments=None, *,
                  k_start=None):
  """(o, lse) of the call's skip keys alone, in `call.layout` (lse like the priors),
  differentiable in q, k, v and the skip prior (under cotangents on o and lse): its own custom VJP,
  whose residuals are the inputs, o and lse (the backward recomputes the shifts or the column
  views). No explicit key positions; a traced key offset (k_start given) needs a bounded stride."""
  q_start, k_start = _traced_starts(call, q_start, k_start)
  return _stride_piece(call, q, k, v, q_start, k_start, skip_prior, q_segments, k_segments)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stride_piece(call, q, k, v, q_start, k_start, sp, qseg, kseg):
  return _stride_forward(call, q, k, v, *_starts(call, q_start, k_start), sp, qseg, kseg)


def _stride_piece_fwd(call, q, k, v, q_start, k_start, sp, qseg, kseg):
  o, lse = _stride_forward(call, q, k, v, *_starts(call, q_start, k_start), sp, qseg, kseg)
  return (o, lse), (q, k, v, q_start, k_start, sp, qseg, kseg, o, lse)


def _stride_piece_bwd(call, residuals, cotangents):
  q, k, v, q_start, k_start, sp, qseg, kseg, o, lse = residuals
  do, dlse = cotangents
  dq, dk, dv, dsp = _stride_backward(call, q, k, v, *_starts(call, q_start, k_start), sp, qseg,
                                     kseg, o, lse, do, dlse.astype(F32))
  return dq, dk, dv, None, None, dsp, None, None


_stride_piece.defvjp(_stride_piece_fwd, _stride_piece_bwd)


def _stride_apart(call) -> bool:
  """The call's skips run as the stride piece beside the local part (else they are masked in the
  loop over explicit key positions)."""
  return call.pattern.has_skips and not call.explicit


def _explicit(call, k_start):
  """A call with a traced key offset and skips back to the sequence start, as explicit key
  positions (the stride piece cannot place such keys on a static grid)."""
  return dataclasses.replace(call, explicit=True), jnp.asarray(k_start, jnp.int32) + jnp.arange(
      call.Tk, dtype=jnp.int32)


def _plan(call, q_start, k_start) -> Plan:
  return plan_for(call.pattern, call.Tq, call.Tk, q_start=q_start, k_start=k_start,
                  explicit=call.explicit, scale=call.scale, layout=call.layout)


def _backend_attend(call, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior,
                    q_segments, k_segments, *, interpret: bool = False):
  del interpret  # XLA needs no kernel interpreter
  if _stride_apart(call) and call.k_offset is None and call.pattern.skip_to is None:
    call, k_positions = _explicit(call, k_start)
  if not _stride_apart(call):
    return attend(_plan(call, q_start, k_start), q, k, v, q_start, k_start, k_positions,
                  local_prior, skip_prior, q_segments, k_segments)
  return _union(call, q, k, v, *_traced_starts(call, q_start, k_start), local_prior, skip_prior,
                q_segments, k_segments)


# The local part and the stride as one custom VJP: residuals q, k, v, (starts), priors, document
# ids, and the union's o and lse (never the stride's column views, nor either part's o); the
# backward is `_backend_backward`, each part's flash backward at the union's o and lse.

def _traced_starts(call, q_start, k_start):
  """The starts the custom VJPs take: int32 scalars where the call's are traced, None where static
  (or not given: a static key offset places the keys)."""
  traced = lambda static, start: None if static is not None or start is None else jnp.asarray(
      start, jnp.int32)
  return traced(call.q_start, q_start), traced(call.k_start, k_start)


def _starts(call, q_start, k_start):
  return (call.q_start if q_start is None else q_start,
          call.k_start if k_start is None else k_start)


def _union_forward(call, q, k, v, q_start, k_start, lp, sp, qseg, kseg):
  q_start, k_start = _starts(call, q_start, k_start)
  local = attend(_plan(call, q_start, k_start), q, k, v, q_start, k_start, None, lp, None, qseg,
                 kseg)
  return merge([local, _stride_forward(call, q, k, v, q_start, k_start, sp, qseg, kseg)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _union(call, q, k, v, q_start, k_start, lp, sp, qseg, kseg):
  return _union_forward(call, q, k, v, q_start, k_start, lp, sp, qseg, kseg)


def _union_fwd(call, q, k, v, q_start, k_start, lp, sp, qseg, kseg):
  o, lse = _union_forward(call, q, k, v, q_start, k_start, lp, sp, qseg, kseg)
  return (o, lse), (q, k, v, q_start, k_start, lp, sp, qseg, kseg, o, lse)


def _union_bwd(call, residuals, cotangents):
  q, k, v, q_start, k_start, lp, sp, qseg, kseg, o, lse = residuals
  do, dlse = cotangents
  dq, dk, dv, dlp, dsp = _backend_backward(call, q, k, v, *_starts(call, q_start, k_start), None,
                                           lp, sp, qseg, kseg, o, lse, do, dlse.astype(F32))
  return dq, dk, dv, None, None, dlp, dsp, None, None


_union.defvjp(_union_fwd, _union_bwd)


def _backend_backward(call, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior,
                      q_segments, k_segments, o, lse, do, dlse, *, interpret: bool = False):
  del interpret
  if _stride_apart(call) and call.k_offset is None and call.pattern.skip_to is None:
    call, k_positions = _explicit(call, k_start)
  if not _stride_apart(call):
    return attend_backward(_plan(call, q_start, k_start), q, k, v, q_start, k_start, k_positions,
                           local_prior, skip_prior, q_segments, k_segments, o, lse, do, dlse)
  dq, dk, dv, dlp, _ = attend_backward(_plan(call, q_start, k_start), q, k, v, q_start, k_start,
                                       None, local_prior, None, q_segments, k_segments, o, lse, do,
                                       dlse)
  sq, sk, sv, dsp = _stride_backward(call, q, k, v, q_start, k_start, skip_prior, q_segments,
                                     k_segments, o, lse, do, dlse)
  return dq + sq, dk + sk, dv + sv, dlp, dsp


BACKEND = Backend(name="xla", attend=_backend_attend, backward=_backend_backward,
                  doc="the blockwise loop core: every pattern, every platform, O(T) memory")
