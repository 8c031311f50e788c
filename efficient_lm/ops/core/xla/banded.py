"""The banded schedule of the XLA core: a pattern of bounded reach, forward and backward.

Each group of query blocks (`plan.group` blocks of `plan.block` queries) meets
its band of key blocks (`plan.back` before its own, `plan.fwd` after),
gathered by shifting whole blocks, vectorized over the group; a loop runs the
groups. The backward recomputes the probabilities group by group (the
flash-attention backward) and adds each band's key and value gradients back
in place. `schedule.py` calls `forward` / `backward` heads-first.
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops.core import heads
from efficient_lm.ops.core.plan import MASKED, NO_KEY_LSE, Plan, is_static
from efficient_lm.ops.core.xla.arrays import (F32, add_at, pad_axis, slice_at, vma_zero, window,
                                              window_transpose)

# Heads-first (`schedule.py` transposes "BTHK" calls): q, k, v are `[B, H, T, K]` (the sequence on
# axis T_AXIS; k and v may have fewer heads: `heads.einsum`), row quantities (lse, priors, delta)
# `[B, H, rows]`. Einsum letters: g groups' blocks, q queries, m band keys.

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
  q_g = slice_at(q_grid, start, G * L, t)
  qpos = origin + start + jnp.arange(G * L, dtype=jnp.int32)
  band_start = start + plan.front - plan.back * L
  size = (G + nb) * L
  band = lambda buf: _with_previous(_blocks(slice_at(buf, band_start, size, t), G + nb, L),
                                    G, nb, t)
  k_band, v_band = band(k_buf), band(v_buf)
  kpos_band = _with_previous(slice_at(kpos_buf, band_start, size, 0).reshape(G + nb, L), G, nb, 0)
  local_GLM = plan.pattern.local_visible(qpos.reshape(G, L)[:, :, None], kpos_band[:, None, :])
  if qseg_grid is not None:
    qseg_BGL = slice_at(qseg_grid, start, G * L, 1).reshape(B, G, L)
    kseg_BGM = _with_previous(slice_at(kseg_buf, band_start, size, 1).reshape(B, G + nb, L), G,
                              nb, 1)
    local_GLM = (local_GLM & (qseg_BGL[..., None] == kseg_BGM[:, :, None, :]))[:, None]
  s = heads.einsum(QK, _blocks(q_g, G, L), k_band, k_buf.shape[1]) * plan.scale
  if lp_grid is not None:
    s = s + slice_at(lp_grid, start, G * L, 2).reshape(B, H, G, L)[..., None]
  s = jnp.where(local_GLM, s, MASKED)
  return q_g, s, k_band, v_band


def _band_inputs(plan: Plan, q, k, v, q_start, k_start, lp, qseg, kseg):
  origin, phase, key_offset = _band_grid(plan, q_start, k_start)
  rows = plan.groups * plan.group * plan.block
  q_grid = window(q, -phase, rows)
  k_buf = window(k, key_offset, plan.key_rows)
  v_buf = window(v, key_offset, plan.key_rows)
  kpos_buf = _band_key_positions(plan, origin, key_offset)
  lp_grid = None if lp is None else window(lp, -phase, rows)
  segs = (None, None)
  if qseg is not None:
    segs = (window(qseg, -phase, rows, axis=1),
            window(kseg, key_offset, plan.key_rows, axis=1, value=-1))
  return origin, phase, key_offset, q_grid, k_buf, v_buf, kpos_buf, lp_grid, segs


def _groups_loop(plan: Plan, body, carry):
  """body(g, carry) over the groups: a fori_loop, or one static call for a single group."""
  if plan.groups == 1:
    return body(0, carry)
  return jax.lax.fori_loop(0, plan.groups, body, carry)


def forward(plan: Plan, q, k, v, q_start, k_start, lp, sp, qseg, kseg):
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
    acc = _unblocks(heads.einsum(PV, p.astype(v.dtype), v_band, v.shape[1]))
    safe_l = jnp.where(l > 0, l, 1.0)
    o = (acc / safe_l[..., None]).astype(q.dtype)
    lse = jnp.where(l > 0, m + jnp.log(safe_l), NO_KEY_LSE)
    start = g * G * L
    return (jax.lax.dynamic_update_slice_in_dim(o_grid, o, start, axis=T_AXIS),
            jax.lax.dynamic_update_slice_in_dim(lse_grid, lse, start, axis=2))

  zero = vma_zero(q, k, v, q_start, k_start, lp, sp, qseg, kseg)
  o_shape = list(q_grid.shape[:3]) + [Kv]
  init = (jnp.zeros(o_shape, q.dtype) + zero.astype(q.dtype), jnp.zeros((B, H, rows), F32) + zero)
  o_grid, lse_grid = _groups_loop(plan, body, init)
  return window(o_grid, phase, plan.Tq), window(lse_grid, phase, plan.Tq)


def _scatter_band(x: jax.Array, G: int, nb: int, L: int) -> jax.Array:
  """The adjoint of `_with_previous` on a band gradient (blocks on the sequence axis, the band
  after it): the slab gradient, (G + nb) L long."""
  t = T_AXIS
  out = 0.0
  for s in range(nb + 1):
    out = out + pad_axis(jax.lax.slice_in_dim(x, s * L, (s + 1) * L, axis=t + 1), t, s, nb - s)
  return _unblocks(out)


def backward(plan: Plan, q, k, v, q_start, k_start, lp, sp, qseg, kseg, o, lse, do, dlse):
  origin, phase, key_offset, q_grid, k_buf, v_buf, kpos_buf, lp_grid, segs = _band_inputs(
      plan, q, k, v, q_start, k_start, lp, qseg, kseg)
  t = T_AXIS
  B, H, rows = q_grid.shape[:3]
  L, G, nb = plan.block, plan.group, plan.back + plan.fwd
  do_grid = window(do, -phase, rows)
  lse_grid = window(lse, -phase, rows)
  delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1) - dlse
  delta_grid = window(delta, -phase, rows)

  def body(g, carry):
    dq_grid, dlp_grid, dk_buf, dv_buf = carry
    q_g, s, k_band, v_band = _band_group(plan, g, q_grid, k_buf, v_buf, kpos_buf, origin,
                                         lp_grid, *segs)
    start = g * G * L
    lse_g = slice_at(lse_grid, start, G * L, 2)
    delta_g = slice_at(delta_grid, start, G * L, 2)
    do_g = slice_at(do_grid, start, G * L, t)
    do_blk, q_blk = _blocks(do_g, G, L), _blocks(q_g, G, L)
    p = jnp.exp(s - lse_g.reshape(B, H, G, L)[..., None])
    kv_heads = k.shape[1]
    dp = heads.einsum(QK, do_blk, v_band, kv_heads)
    ds = p * (dp - delta_g.reshape(B, H, G, L)[..., None])
    dq = _unblocks(heads.einsum(PV, ds.astype(k.dtype), k_band, kv_heads))
    dk_band = heads.einsum(DKV, ds.astype(q.dtype), q_blk, kv_heads)
    dv_band = heads.einsum(DKV, p.astype(do.dtype), do_blk, kv_heads)
    band_start = start + plan.front - plan.back * L
    dk_buf = add_at(dk_buf, band_start, plan.scale * _scatter_band(dk_band, G, nb, L), t)
    dv_buf = add_at(dv_buf, band_start, _scatter_band(dv_band, G, nb, L), t)
    if lp_grid is not None:
      dlp_grid = jax.lax.dynamic_update_slice_in_dim(
          dlp_grid, jnp.sum(ds, axis=-1).reshape(B, H, G * L), start, axis=2)
    dq_grid = jax.lax.dynamic_update_slice_in_dim(dq_grid, dq * plan.scale, start, axis=t)
    return dq_grid, dlp_grid, dk_buf, dv_buf

  zero = vma_zero(q, k, v, q_start, k_start, lp, sp, qseg, kseg, do, dlse)
  zeros_rows = jnp.zeros((B, H, rows), F32) + zero
  buf_shape = lambda x, n: tuple(n if a == t else d for a, d in enumerate(x.shape))
  init = (jnp.zeros(buf_shape(q, rows), F32) + zero, zeros_rows if lp is not None else None,
          jnp.zeros(buf_shape(k, plan.key_rows), F32) + zero,
          jnp.zeros(buf_shape(v, plan.key_rows), F32) + zero)
  dq_grid, dlp_grid, dk_buf, dv_buf = _groups_loop(plan, body, init)
  dq = window(dq_grid, phase, plan.Tq).astype(q.dtype)
  dk = window_transpose(dk_buf, key_offset, plan.Tk).astype(k.dtype)
  dv = window_transpose(dv_buf, key_offset, plan.Tk).astype(v.dtype)
  dlp = None if lp is None else window(dlp_grid, phase, plan.Tq)
  dsp = None if sp is None else jnp.zeros_like(sp)  # a band plan has no skip keys
  return dq, dk, dv, dlp, dsp
