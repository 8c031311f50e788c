"""The looped schedule of the XLA core: a pattern of unbounded reach, forward and backward.

Each query block (`plan.q_block` queries) loops over the key blocks its
pattern allows (`Pattern.key_range`, bounds traced when the starts are; all
of them with explicit key positions, where the skips are masked here too),
with an online softmax. The backward recomputes the probabilities block by
block (the flash-attention backward), adding each key block's gradients in
place. `schedule.py` calls `forward` / `backward` heads-first: q, k, v
`[B, H, T, K]` (k and v may have fewer heads: `heads.einsum`), row quantities `[B, H, Tq]`.
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops.core import heads
from efficient_lm.ops.core.plan import MASKED, NO_KEY_LSE, Plan, cdiv, is_static
from efficient_lm.ops.core.xla.arrays import F32, add_at, slice_at, vma_zero, window


def _loop_inputs(plan: Plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg):
  Lq, Lk = plan.q_block, plan.k_block
  NQ, NK = cdiv(plan.Tq, Lq), cdiv(plan.Tk, Lk)
  qs = plan.q_start if plan.q_start is not None else q_start
  ks = plan.k_start if plan.k_start is not None else k_start
  q_buf = window(q, 0, NQ * Lq)
  k_buf = window(k, 0, NK * Lk)
  v_buf = window(v, 0, NK * Lk)
  if plan.explicit:
    kpos_buf = window(k_pos.astype(jnp.int32), 0, NK * Lk, axis=0, value=-1)
  else:
    index = jnp.arange(NK * Lk, dtype=jnp.int32)
    kpos_buf = jnp.where(index < plan.Tk, ks + index, -1)
  qpos_buf = qs + jnp.arange(NQ * Lq, dtype=jnp.int32)
  lp_buf = None if lp is None else window(lp, 0, NQ * Lq)
  sp_buf = None if sp is None else window(sp, 0, NQ * Lq)
  segs = (None, None)
  if qseg is not None:
    segs = (window(qseg, 0, NQ * Lq, axis=1), window(kseg, 0, NK * Lk, axis=1, value=-1))
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
  s = heads.einsum("bhqk,bhsk->bhqs", q_i, k_j, k_j.shape[1]) * plan.scale
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


def forward(plan: Plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg):
  qs, ks, NQ, NK, q_buf, k_buf, v_buf, kpos_buf, qpos_buf, lp_buf, sp_buf, segs = _loop_inputs(
      plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg)
  qseg_buf, kseg_buf = segs
  B, H, _, _ = q_buf.shape
  Kv = v.shape[-1]
  Lq, Lk = plan.q_block, plan.k_block
  zero = vma_zero(q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg)

  def q_body(i, carry):
    o_buf, lse_buf = carry
    q_i = slice_at(q_buf, i * Lq, Lq, 2)
    qpos_i = slice_at(qpos_buf, i * Lq, Lq, 0)
    lp_i = None if lp_buf is None else slice_at(lp_buf, i * Lq, Lq, 2)
    sp_i = None if sp_buf is None else slice_at(sp_buf, i * Lq, Lq, 2)
    qseg_i = None if qseg_buf is None else slice_at(qseg_buf, i * Lq, Lq, 1)

    def k_body(j, state):
      m, l, acc = state
      k_j = k_buf if NK == 1 else slice_at(k_buf, j * Lk, Lk, 2)
      v_j = v_buf if NK == 1 else slice_at(v_buf, j * Lk, Lk, 2)
      kpos_j = kpos_buf if NK == 1 else slice_at(kpos_buf, j * Lk, Lk, 0)
      kseg_j = _key_segments(kseg_buf, j, Lk, NK)
      s, _, _ = _block_logits(plan, q_i, qpos_i, k_j, kpos_j, lp_i, sp_i, qseg_i, kseg_j)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      correction = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new[..., None])
      l = l * correction + jnp.sum(p, axis=-1)
      acc = acc * correction[..., None] + heads.einsum(
          "bhqs,bhsk->bhqk", p.astype(v.dtype), v_j, v_j.shape[1])
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


def backward(plan: Plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg, o, lse, do, dlse):
  qs, ks, NQ, NK, q_buf, k_buf, v_buf, kpos_buf, qpos_buf, lp_buf, sp_buf, segs = _loop_inputs(
      plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg)
  qseg_buf, kseg_buf = segs
  B, H, _, K = q_buf.shape
  Lq, Lk = plan.q_block, plan.k_block
  rows = NQ * Lq
  zero = vma_zero(q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg, do, dlse)
  do_buf = window(do, 0, rows)
  lse_buf = window(lse, 0, rows)
  delta_buf = window(jnp.sum(do.astype(F32) * o.astype(F32), axis=-1) - dlse, 0, rows)

  def q_body(i, carry):
    dq_buf, dlp_buf, dsp_buf, dk_buf, dv_buf = carry
    q_i = slice_at(q_buf, i * Lq, Lq, 2)
    qpos_i = slice_at(qpos_buf, i * Lq, Lq, 0)
    do_i = slice_at(do_buf, i * Lq, Lq, 2)
    lse_i = slice_at(lse_buf, i * Lq, Lq, 2)
    delta_i = slice_at(delta_buf, i * Lq, Lq, 2)
    lp_i = None if lp_buf is None else slice_at(lp_buf, i * Lq, Lq, 2)
    sp_i = None if sp_buf is None else slice_at(sp_buf, i * Lq, Lq, 2)
    qseg_i = None if qseg_buf is None else slice_at(qseg_buf, i * Lq, Lq, 1)

    def k_body(j, state):
      dq_i, dlp_i, dsp_i, dk_buf, dv_buf = state
      k_j = k_buf if NK == 1 else slice_at(k_buf, j * Lk, Lk, 2)
      v_j = v_buf if NK == 1 else slice_at(v_buf, j * Lk, Lk, 2)
      kpos_j = kpos_buf if NK == 1 else slice_at(kpos_buf, j * Lk, Lk, 0)
      kseg_j = _key_segments(kseg_buf, j, Lk, NK)
      s, local, skip = _block_logits(plan, q_i, qpos_i, k_j, kpos_j, lp_i, sp_i, qseg_i, kseg_j)
      p = jnp.exp(s - lse_i[..., None])
      kv_heads = k_j.shape[1]
      dp = heads.einsum("bhqk,bhsk->bhqs", do_i, v_j, kv_heads)
      ds = p * (dp - delta_i[..., None])
      dq_i = dq_i + heads.einsum("bhqs,bhsk->bhqk", ds.astype(k.dtype), k_j, kv_heads)
      dk_j = heads.einsum("bhqs,bhqk->bhsk", ds.astype(q.dtype), q_i, kv_heads)
      dv_j = heads.einsum("bhqs,bhqk->bhsk", p.astype(do.dtype), do_i, kv_heads)
      dk_buf = add_at(dk_buf, j * Lk, plan.scale * dk_j)
      dv_buf = add_at(dv_buf, j * Lk, dv_j)
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
          jnp.zeros((B, k.shape[1], NK * Lk, K), F32) + zero,
          jnp.zeros((B, v.shape[1], NK * Lk, v.shape[-1]), F32) + zero)
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
  return kseg_buf if NK == 1 else slice_at(kseg_buf, j * Lk, Lk, 1)
