"""π's stride on the XLA core: the skip keys of every query, one piece however many.

π's skips (one stride term) are one more piece beside the local part, merged
with it by log-sum-exp. A few skips (at most `SHIFT_SKIPS` landing in the
call, a static key offset) run as *shifts*: one shifted view of the keys per
skip distance, in the call's layout. More run as the *row call*: with the
keys viewed as `[T / period, period]`, query a * period + b sees rows
a - skip_to .. a - skip_from of column b, a window along the row axis, run by
the core (`schedule.attend`) batched over the columns. `forward` / `backward`
pick the way per call (at trace time); `stride_attend` is the piece alone with
its own custom VJP (what a kernel's π call runs beside the kernel). Explicit
key positions (decoding caches) never come here: the looped schedule masks the
skips instead.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from efficient_lm.ops.core import heads
from efficient_lm.ops.core.plan import MASKED, NO_KEY_LSE, Plan, cdiv, plan_for
from efficient_lm.ops.core.xla.arrays import F32, window
from efficient_lm.ops.core.xla.schedule import attend, attend_backward, starts, traced_starts
from efficient_lm.ops.pattern import Pattern

# The row call: the skip keys of every query as one call of the core over the period's columns.

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
  w = window(x, start, rows * P, axis=axis, value=value)
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
  o = window(_from_columns(o_c, geo.period, t), 0, call.Tq, axis=t)
  return o, window(_from_columns(lse_c, geo.period, t), 0, call.Tq, axis=t)


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
  back = lambda y, start, n: window(_from_columns(y, P, t), start, n, axis=t)
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
    s = heads.rows_dot(q, window(k, offset, call.Tq, axis=t), 3 - t) * call.scale
    if skip_prior is not None:
      s = s + skip_prior.astype(F32)
    seen = ((i + offset >= 0) & (i + offset < call.Tk)
            & (jnp.asarray(q_start, jnp.int32) + i - m * call.pattern.period >= 0))[None]
    if q_segments is not None:
      seen = seen & (q_segments == window(k_segments, offset, call.Tq, axis=1, value=_NO_DOCUMENT))
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
      heads.scaled(p_m[..., None], window(v, -(m * call.pattern.period + call.k_offset), call.Tq,
                                          axis=t), 3 - t) for m, p_m in zip(ms, p)])
  safe = jnp.where(l > 0, l, 1.0)
  return ((acc / safe[..., None]).astype(q.dtype),
          jnp.where(l > 0, peak + jnp.log(safe), NO_KEY_LSE))


def _shift_backward(call, ms, q, k, v, q_start, skip_prior, q_segments, k_segments, o, lse, do,
                    dlse):
  """(dq, dk, dv, d skip_prior) of the shifts at the given o and lse (the flash backward)."""
  t = 1 if call.layout == "BTHK" else 2
  h = 3 - t  # the heads axis
  logits = _shift_logits(call, ms, q, k, q_start, skip_prior, q_segments, k_segments)
  delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1) - dlse
  dq = dk = dv = dsp = 0.0
  for m, s in zip(ms, logits):
    offset = -(m * call.pattern.period + call.k_offset)
    k_m, v_m = (window(x, offset, call.Tq, axis=t) for x in (k, v))
    p = jnp.exp(s - lse)
    ds = p * (heads.rows_dot(do, v_m, h) - delta)
    dq = dq + heads.scaled(ds[..., None], k_m, h)
    dk = dk + window(heads.group_sum(ds[..., None] * q.astype(F32), h, k.shape[h]), -offset,
                     call.Tk, axis=t)
    dv = dv + window(heads.group_sum(p[..., None] * do.astype(F32), h, v.shape[h]), -offset,
                     call.Tk, axis=t)
    dsp = dsp + ds
  return ((dq * call.scale).astype(q.dtype), (dk * call.scale).astype(k.dtype), dv.astype(v.dtype),
          None if skip_prior is None else dsp)


# The stride piece: the shifts for a few skips (`_shift_skips`), else the row call.

def forward(call, q, k, v, q_start, k_start, skip_prior, q_segments, k_segments):
  """(o, lse) of the stride piece in `call.layout`: the shifts or the row call."""
  ms = _shift_skips(call)
  if ms is not None:
    if not ms:
      return _no_keys(call, q, v)
    return _shift_forward(call, ms, q, k, v, q_start, skip_prior, q_segments, k_segments)
  geo = _stride_of(call)
  if geo is None:
    return _no_keys(call, q, v)
  return _rows_forward(call, geo, q, k, v, q_start, k_start, skip_prior, q_segments, k_segments)


def backward(call, q, k, v, q_start, k_start, skip_prior, q_segments, k_segments, o, lse, do,
             dlse):
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
  q_start, k_start = traced_starts(call, q_start, k_start)
  return _stride_piece(call, q, k, v, q_start, k_start, skip_prior, q_segments, k_segments)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stride_piece(call, q, k, v, q_start, k_start, sp, qseg, kseg):
  return forward(call, q, k, v, *starts(call, q_start, k_start), sp, qseg, kseg)


def _stride_piece_fwd(call, q, k, v, q_start, k_start, sp, qseg, kseg):
  o, lse = forward(call, q, k, v, *starts(call, q_start, k_start), sp, qseg, kseg)
  return (o, lse), (q, k, v, q_start, k_start, sp, qseg, kseg, o, lse)


def _stride_piece_bwd(call, residuals, cotangents):
  q, k, v, q_start, k_start, sp, qseg, kseg, o, lse = residuals
  do, dlse = cotangents
  dq, dk, dv, dsp = backward(call, q, k, v, *starts(call, q_start, k_start), sp, qseg, kseg, o,
                             lse, do, dlse.astype(F32))
  return dq, dk, dv, None, None, dsp, None, None


_stride_piece.defvjp(_stride_piece_fwd, _stride_piece_bwd)
