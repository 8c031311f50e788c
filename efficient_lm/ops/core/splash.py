"""The `splash` backend: jax's Pallas TPU splash-attention kernels, masks from the `Pattern`.

Contract (`call.Backend`): `attend(call, q, k, v, ...) -> (o, lse)`, differentiable in
q, k, v and the priors under cotangents on o and lse; `backward` at a given o and lse (ring
steps). `unsupported` names the calls it cannot run, which the front door runs on `xla`:
explicit key positions, a traced k_offset, an unknown block phase, dtypes other than float32 /
bfloat16. One kernel call holds at most `MAX_KEYS` (65,408) keys (16-bit bounds): a longer call is
cut into pieces of queries and keys (`pieces`), one kernel call per piece pair that sees any key,
merged by log-sum-exp. Tiles follow the pattern's reach (`tile`: 128 to 512). π's skips run beside
the kernel (`skips.kernel_attend`). Document ids go to the kernel as its `SegmentIds` (the call is
then mapped over the batch: one id array per row). `interpret=True` runs the kernels in Pallas
interpret mode (CPU tests).

Details (the interval mask, the cached block tables, the backward): docs/architecture.md,
"Attention core".
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as sinfo

from efficient_lm.runtime import jax_compat
from efficient_lm.ops.core import kernel_mesh, skips
from efficient_lm.ops.core.call import KERNEL_CALLS, Backend, Call
from efficient_lm.ops.core.merge import merge
from efficient_lm.ops.core.plan import NO_KEY_LSE, cdiv
from efficient_lm.ops.pattern import Pattern

F32 = jnp.float32

# Kernel tiles: multiples of 128 (the kernels' lane width), shrunk to the call for short ones.
BLOCK_Q = 512
BLOCK_KV = 512
BLOCK_KV_COMPUTE = 512
LANES = 128
MAX_KEYS = (1 << 16) - LANES  # a key bound (0..padded Tk) must fit in 16 bits
PIECE = MAX_KEYS // BLOCK_KV * BLOCK_KV  # the most keys (and queries) of one call of a long one

DTYPES = ("float32", "bfloat16")
_MASK_VALUE = sk.DEFAULT_MASK_VALUE
_LAYOUT = sk.QKVLayout.HEAD_DIM_MINOR


# Which calls the kernel takes.

def pattern_unsupported(pattern: Pattern) -> str | None:
  """None: every `Pattern`'s local part is one key interval per query, and skips run beside."""
  del pattern
  return None


def tile(pattern: Pattern) -> int:
  """The kernel's tile (queries and keys) for `pattern`: its local reach rounded up to a power of
  two, between 128 (the lanes) and 512; 512 for unbounded reach. A window of 128 then visits two
  128-key blocks per 128 queries, not two 512-key blocks per 512 queries (4x the work)."""
  reach = pattern.local.reach
  return BLOCK_Q if reach is None else min(BLOCK_Q, max(LANES, 1 << reach.bit_length()))


def pieces(length: int, unit: int) -> list[tuple[int, int]]:
  """(start, length) of the pieces one axis of a call is cut into: one piece when the padded
  length fits one kernel call, else equal pieces of a multiple of `unit`, at most `PIECE`."""
  if _padded(length, BLOCK_KV) <= MAX_KEYS:
    return [(0, length)]
  size = cdiv(cdiv(length, cdiv(length, PIECE)), unit) * unit
  return [(s, min(size, length - s)) for s in range(0, length, size)]


def _block(length: int, limit: int) -> int:
  """The kernel tile along a sequence of `length`: a multiple of 128, at most `limit`."""
  return min(limit, cdiv(length, LANES) * LANES)


def _padded(length: int, block: int) -> int:
  return cdiv(length, block) * block


def unsupported(call: Call) -> str | None:
  """Why the splash backend cannot run `call` (the front door then runs `xla`), or None."""
  if (missing := jax_compat.splash_missing()) is not None:  # this jax lacks the kernels' pieces
    return missing
  if call.explicit:
    return ("explicit key positions (decoding caches): the kernel places keys at "
            "k_start + arange(Tk)")
  if call.k_offset is None:
    return "a traced key offset (ring steps): the kernel's mask needs k_start - q_start static"
  if call.q_phase is None:
    return (f"q_start is traced and not known to be a multiple of block_size="
            f"{call.pattern.block_size} (pass q_align): the mask needs the block phase")
  if call.dtype not in DTYPES:
    return f"dtype {call.dtype}: the kernel takes {', '.join(DTYPES)}"
  return pattern_unsupported(call.pattern)


# The mask: one key interval per query, and the key blocks each query block visits.

@dataclasses.dataclass(frozen=True)
class _Spec:
  """Everything static about one kernel call (hashable: the custom VJP's static argument)."""
  pattern: Pattern  # the local part
  Tq: int
  Tk: int
  k_offset: int
  phase: int        # q_start modulo the block size (0 without blocks)
  min_key: int      # keys below this index are at negative positions (static starts), else 0
  bq: int
  bkv: int
  interpret: bool

  @property
  def Tq_pad(self) -> int:
    return _padded(self.Tq, self.bq)

  @property
  def Tk_pad(self) -> int:
    return _padded(self.Tk, self.bkv)

  @property
  def block_sizes(self) -> sk.BlockSizes:
    compute = min(self.bkv, BLOCK_KV_COMPUTE)
    return sk.BlockSizes(block_q=self.bq, block_kv=self.bkv, block_kv_compute=compute,
                         block_q_dkv=self.bq, block_kv_dkv=self.bkv, block_kv_dkv_compute=compute,
                         block_q_dq=self.bq, block_kv_dq=self.bkv)


def _intervals(spec: _Spec) -> tuple[np.ndarray, np.ndarray]:
  """(lo, hi) `[Tq_pad]` int64: query i sees key indices lo <= j < hi (lo = hi = 0: none).

  Positions relative to a q_start of `phase`: the pattern only sees q_start through the block
  phase, and the keys' sign is applied separately (`min_key`, or in-graph when traced)."""
  pattern = spec.pattern
  p = spec.phase + np.arange(spec.Tq, dtype=np.int64)
  lo = np.full(spec.Tq, np.iinfo(np.int32).min, np.int64)
  hi = np.full(spec.Tq, np.iinfo(np.int32).max, np.int64)  # inclusive here
  if pattern.causal:
    hi = np.minimum(hi, p)
  if pattern.window is not None:
    lo = np.maximum(lo, p - pattern.window + 1)
  if pattern.block_size is not None:
    block = p // pattern.block_size
    lo = np.maximum(lo, (block - pattern.lookback) * pattern.block_size)
    hi = np.minimum(hi, (block + 1) * pattern.block_size - 1)
  base = spec.phase + spec.k_offset  # the position of key index 0
  lo = np.clip(lo - base, spec.min_key, spec.Tk)
  hi = np.clip(hi - base + 1, 0, spec.Tk)
  empty = lo >= hi
  lo, hi = np.where(empty, 0, lo), np.where(empty, 0, hi)
  pad = spec.Tq_pad - spec.Tq
  return np.pad(lo, (0, pad)), np.pad(hi, (0, pad))


def _block_classes(lo, hi, bq: int, bkv: int, nk: int) -> np.ndarray:
  """`[nq, nk]` int32: 0 no query of the block sees a key of the block, 1 some, 2 all."""
  nq = len(lo) // bq
  classes = np.zeros((nq, nk), np.int32)
  starts = np.arange(nk, dtype=np.int64) * bkv
  rows = max(1, (1 << 22) // max(nk, 1) // bq) * bq  # bounded temporaries
  for r in range(0, len(lo), rows):
    l, h = lo[r:r + rows, None], hi[r:r + rows, None]
    seen = np.maximum(0, np.minimum(h, starts + bkv) - np.maximum(l, starts))  # [rows, nk]
    counts = seen.reshape(-1, bq, nk).sum(axis=1)
    a = r // bq
    classes[a:a + len(counts)] = np.where(counts == bq * bkv, 2, np.where(counts > 0, 1, 0))
  return classes


def _small(x: np.ndarray) -> np.ndarray:
  """The smallest integer type holding x (the kernels keep these tables in scalar memory)."""
  top = int(x.max()) if x.size else 0
  return x.astype(np.int8 if top <= 127 else np.int16 if top <= 32767 else np.int32)


def _shrunk(classes: np.ndarray, by_rows: bool) -> tuple[np.ndarray, np.ndarray]:
  """(block_mask, data_next) `[1, ...]` of splash's shrunk grid.

  by_rows (forward, dq): for each query block, the key blocks it visits, `[1, nq, width]`,
  padded after with class 0 (skipped) repeating the last index (no new fetch). Otherwise
  (dkv): for each key block the query blocks, `[1, width, nk]`, padded before."""
  lines = classes if by_rows else classes.T
  visits = [np.nonzero(line)[0] for line in lines]
  width = max(1, max(len(v) for v in visits))
  block_mask = np.zeros((len(lines), width), np.int32)
  data_next = np.zeros((len(lines), width), np.int32)
  for n, (line, v) in enumerate(zip(lines, visits)):
    if not len(v):
      continue
    at = slice(0, len(v)) if by_rows else slice(width - len(v), width)
    block_mask[n, at] = line[v]
    data_next[n] = v[-1] if by_rows else v[0]
    data_next[n, at] = v
  if not by_rows:
    block_mask, data_next = block_mask.T, data_next.T
  return _small(block_mask)[None], _small(data_next)[None]


@dataclasses.dataclass(frozen=True)
class _Masks:
  lo: np.ndarray          # [Tq_pad] static key intervals
  hi: np.ndarray
  fwd: tuple              # (block_mask, data_next): forward and dq
  dkv: tuple              # (block_mask, data_next): dk / dv


@functools.lru_cache(maxsize=64)
def _masks(spec: _Spec) -> _Masks:
  lo, hi = _intervals(spec)
  classes = _block_classes(lo, hi, spec.bq, spec.bkv, spec.Tk_pad // spec.bkv)
  return _Masks(lo=lo, hi=hi, fwd=_shrunk(classes, by_rows=True),
                dkv=_shrunk(classes, by_rows=False))


def _interval_mask(q_bounds, k_index):
  """The kernels' mask function: key index k_index in [lo, hi) of its query's packed bounds."""
  lo = jax.lax.shift_right_logical(q_bounds, 16)
  hi = q_bounds & 0xFFFF
  return (k_index >= lo) & (k_index < hi)


def _bounds(spec: _Spec, k_start) -> jax.Array:
  """`[Tq_pad]` int32: each query's (lo << 16 | hi); lo raised past negative key positions
  when k_start is traced."""
  masks = _masks(spec)
  lo, hi = masks.lo, masks.hi
  if k_start is None:
    return jnp.asarray(((lo.astype(np.uint32) << 16) | hi.astype(np.uint32)).view(np.int32))
  lo = jnp.clip(jnp.maximum(jnp.asarray(lo, jnp.int32), -k_start), 0, spec.Tk)
  packed = jax.lax.shift_left(lo.astype(jnp.uint32), jnp.uint32(16)) | jnp.asarray(hi, jnp.uint32)
  return jax.lax.bitcast_convert_type(packed, jnp.int32)


def _info(table: tuple, bounds: jax.Array) -> sinfo.MaskInfo:
  block_mask, data_next = table
  return sinfo.MaskInfo(data_next=jnp.asarray(data_next), mask_next=None,
                        block_mask=jnp.asarray(block_mask), partial_mask_blocks=None,
                        q_sequence=bounds)


# The kernel on `[N, T, K]` arrays (N = batch x heads, T padded), with its custom VJP.

def _empty(bounds: jax.Array) -> jax.Array:
  return jax.lax.shift_right_logical(bounds, 16) >= (bounds & 0xFFFF)


def _segment_ids(qseg, kseg):
  return None if qseg is None else sk.SegmentIds(q=qseg, kv=kseg)


def _forward(spec: _Spec, q, k, v, bounds, qseg=None, kseg=None):
  o, (lse,) = jax_compat.splash_forward(
      _info(_masks(spec).fwd, bounds), q, k, v, _segment_ids(qseg, kseg), None,
      mask_value=_MASK_VALUE, is_mqa=False, block_sizes=spec.block_sizes,
      residual_checkpoint_name=None, save_residuals=True, mask_function=_interval_mask,
      interpret=spec.interpret)
  # Rows with no key: the kernel leaves them undefined where no block ran (NaN), and averages
  # masked keys where every key of a block was another document's (lse near the mask value).
  empty = _empty(bounds)[None] | (lse < NO_KEY_LSE)
  o = jnp.where(empty[..., None], 0, o).astype(q.dtype)
  return o, jnp.where(empty, NO_KEY_LSE, lse.astype(F32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _splash(spec: _Spec, q, k, v, bounds, qseg=None, kseg=None):
  return _forward(spec, q, k, v, bounds, qseg, kseg)


def _splash_fwd(spec: _Spec, q, k, v, bounds, qseg=None, kseg=None):
  o, lse = _forward(spec, q, k, v, bounds, qseg, kseg)
  return (o, lse), (q, k, v, bounds, qseg, kseg, o, lse)


def _splash_bwd(spec: _Spec, residuals, cotangents):
  dq, dk, dv = _gradients(spec, residuals, cotangents)
  return dq, dk, dv, None, None, None


def _gradients(spec: _Spec, residuals, cotangents):
  """(dq, dk, dv) at the residuals' o and lse (`[N, T, K]` arrays): the kernels' backward."""
  q, k, v, bounds, qseg, kseg, o, lse = residuals
  do, dlse = cotangents
  do = do.astype(q.dtype)
  # Empty rows: every logit is the kernel's mask value, far below NO_KEY_LSE: p = 0 there.
  di = jnp.einsum("ntk,ntk->nt", o.astype(F32), do.astype(F32)) - dlse.astype(F32)
  masks = _masks(spec)
  common = dict(is_mqa=False, mask_value=_MASK_VALUE, attn_logits_soft_cap=None,
                q_layout=_LAYOUT, k_layout=_LAYOUT, v_layout=_LAYOUT,
                mask_function=_interval_mask, interpret=spec.interpret)
  sizes = spec.block_sizes
  segment_ids = _segment_ids(qseg, kseg)
  _, dk, dv = jax_compat.splash_bwd_dkv(
      q, k, v, segment_ids, None, lse, do, di, bq=sizes.block_q_dkv, bkv=sizes.block_kv_dkv,
      bkv_compute=sizes.block_kv_dkv_compute, mask_info=_info(masks.dkv, bounds),
      use_fused_bwd_kernel=False, **common)
  dq = jax_compat.splash_bwd_dq(
      q, k, v, segment_ids, None, lse, do, di, bq=sizes.block_q_dq, bkv=sizes.block_kv_dq,
      mask_info=_info(masks.fwd, bounds), **common)
  return dq, dk, dv


_splash.defvjp(_splash_fwd, _splash_bwd)


# The backend.

def _kernel_inputs(spec: _Spec, scale: float, layout: str, q, k, v, qseg, kseg):
  """q (scaled), k, v as `[B, H, T_pad, K]`, and the document ids `[B, T_pad]` (padded queries
  -1, padded keys -2) or None."""
  if layout == "BTHK":
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
  pad = lambda x, length: jnp.pad(x, [(0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)])
  q = pad((q * jnp.asarray(scale, q.dtype)).astype(q.dtype), spec.Tq_pad)
  k, v = (pad(x.astype(q.dtype), spec.Tk_pad) for x in (k, v))
  if qseg is None:
    return (q, k, v), None
  ids = lambda x, length, fill: jnp.pad(x, [(0, 0), (0, length - x.shape[1])], constant_values=fill)
  return (q, k, v), (ids(qseg, spec.Tq_pad, -1), ids(kseg, spec.Tk_pad, -2))


def _per_row(fn, segs, *arrays):
  """`fn(*arrays[, qseg, kseg])` on `[B, H, T, ...]` arrays: one kernel call over the B * H
  rows, or, with document ids, one per batch row (the kernel takes one id array a call). k and v
  may have fewer heads (H_kv): the kernel groups the query heads itself (query row b * H + h
  reads key row (b * H + h) // G = b * H_kv + h // G, as a batch row's would)."""
  B = arrays[0].shape[0]
  if segs is None:
    outs = fn(*(x.reshape(B * x.shape[1], *x.shape[2:]) for x in arrays))
    return tuple(x.reshape(B, x.shape[0] // B, *x.shape[1:]) for x in outs)
  return jax.vmap(fn)(*arrays, *segs)


def _to_layout(layout: str, length: int, x):
  """`[B, H, T_pad, ...]` -> the call's layout, the first `length` positions."""
  x = x[:, :, :length]
  return jnp.swapaxes(x, 1, 2) if layout == "BTHK" else x


def _local_shard(spec: _Spec, scale: float, layout: str, q, k, v, k_start, qseg=None, kseg=None):
  """The kernel's (o, lse) on one shard's arrays, in `layout` (lse: `[B, Tq, H]` / `[B, H, Tq]`)."""
  (q, k, v), segs = _kernel_inputs(spec, scale, layout, q, k, v, qseg, kseg)
  bounds = _bounds(spec, k_start)
  o, lse = _per_row(lambda q, k, v, *ids: _splash(spec, q, k, v, bounds, *ids), segs, q, k, v)
  return _to_layout(layout, spec.Tq, o), _to_layout(layout, spec.Tq, lse)


def _backward_shard(spec: _Spec, scale: float, layout: str, q, k, v, k_start, qseg, kseg, o, lse,
                    do, dlse):
  """(dq, dk, dv) of the kernel's call at a given o and lse, on one shard, in `layout`."""
  dtypes = q.dtype, k.dtype, v.dtype
  (q, k, v), segs = _kernel_inputs(spec, scale, layout, q, k, v, qseg, kseg)
  (o, do, _), _ = _kernel_inputs(spec, 1.0, layout, o, do.astype(o.dtype), do, None, None)
  rows = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2) if layout == "BTHK" else x,
                           [(0, 0), (0, 0), (0, spec.Tq_pad - spec.Tq)]).astype(F32)
  bounds = _bounds(spec, k_start)

  def grads(q, k, v, o, lse, do, dlse, *ids):
    ids = ids or (None, None)
    return _gradients(spec, (q, k, v, bounds, *ids, o, lse), (do, dlse))

  dq, dk, dv = _per_row(grads, segs, q, k, v, o, rows(lse), do, rows(dlse))
  dq = dq * jnp.asarray(scale, dq.dtype)  # the kernel saw scaled queries
  return tuple(_to_layout(layout, n, g).astype(t)
               for g, n, t in zip((dq, dk, dv), (spec.Tq, spec.Tk, spec.Tk), dtypes))


def _spec_for(call: Call, pattern: Pattern, interpret: bool) -> _Spec:
  min_key = 0 if call.k_start is None else min(max(0, -call.k_start), call.Tk)
  size = tile(pattern)
  return _Spec(pattern=pattern, Tq=call.Tq, Tk=call.Tk, k_offset=call.k_offset,
               phase=call.q_phase, min_key=min_key, bq=_block(call.Tq, size),
               bkv=_block(call.Tk, size), interpret=bool(interpret))


def _piece_pairs(call: Call, pattern: Pattern, interpret: bool):
  """[(query piece, [(key piece, its call, its spec)])] of `call`: every pair whose mask sees a
  key (from the static intervals; keys at traced negative positions only see fewer)."""
  unit = math.lcm(LANES, pattern.block_size or 1)
  out = []
  for qs, ql in pieces(call.Tq, unit):
    pairs = []
    for ks, kl in pieces(call.Tk, unit):
      sub = dataclasses.replace(
          call, Tq=ql, Tk=kl, q_start=None if call.q_start is None else call.q_start + qs,
          k_start=None if call.k_start is None else call.k_start + ks,
          k_offset=call.k_offset + ks - qs,
          q_align=math.gcd(call.q_align, qs) if qs else call.q_align)
      spec = _spec_for(sub, pattern, interpret)
      if np.any(_masks(spec).fwd[0]):
        pairs.append(((ks, kl), sub, spec))
    out.append(((qs, ql), pairs))
  return out


def _record(spec: _Spec) -> None:
  KERNEL_CALLS[("splash", f"{spec.bq}x{spec.bkv} tiles")] += 1


def _traced_start(call: Call, k_start):
  return None if call.k_start is not None else jnp.asarray(k_start, jnp.int32)


def _kinds(*arrays_and_kinds):
  arrays = [a for a, _ in arrays_and_kinds]
  return arrays, [kind if a is not None else "none" for a, kind in arrays_and_kinds]


def _take(x, start: int, length: int, axis: int):
  return None if x is None else jax.lax.slice_in_dim(x, start, start + length, axis=axis)


def _one_call(call: Call, spec: _Spec, q, k, v, k_start, qseg, kseg):
  _record(spec)
  fn = functools.partial(_local_shard, spec, call.scale, call.layout)
  arrays, kinds = _kinds((q, "qkv"), (k, "kv"), (v, "kv"),
                         (_traced_start(call, k_start), "replicated"), (qseg, "ids"), (kseg, "ids"))
  return kernel_mesh.per_shard(fn, arrays, kinds, ["qkv", "rows"], layout=call.layout)


def _local_attend(call: Call, q, k, v, k_start, qseg, kseg, interpret: bool):
  """(o, lse) of the call's local pattern, no priors, per shard: one kernel call, or one per
  piece pair of a call longer than one kernel call holds, merged by log-sum-exp."""
  t = 1 if call.layout == "BTHK" else 2
  outputs = []
  for (qs, ql), pairs in _piece_pairs(call, call.pattern.local, interpret):
    q_p, qseg_p = _take(q, qs, ql, t), _take(qseg, qs, ql, 1)
    parts = [_one_call(sub, spec, q_p, _take(k, ks, kl, t), _take(v, ks, kl, t),
                       None if call.k_start is not None else k_start + ks, qseg_p,
                       _take(kseg, ks, kl, 1)) for (ks, kl), sub, spec in pairs]
    if not parts:  # no query of the piece sees a key
      lse = jnp.zeros_like(q_p[..., 0], F32) + NO_KEY_LSE
      parts = [(jnp.zeros(q_p.shape[:-1] + v.shape[-1:], q.dtype), lse)]
    outputs.append(merge(parts))
  if len(outputs) == 1:
    return outputs[0]
  return (jnp.concatenate([o for o, _ in outputs], axis=t),
          jnp.concatenate([lse for _, lse in outputs], axis=t))


def attend(call, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior, q_segments,
           k_segments, *, interpret: bool = False):
  del k_positions  # None: `unsupported` sends explicit positions to xla
  local = lambda q, k, v: _local_attend(call, q, k, v, k_start, q_segments, k_segments, interpret)
  return skips.kernel_attend(local, call, q, k, v, q_start, local_prior, skip_prior, q_segments,
                             k_segments)


def backward(call, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior, q_segments,
             k_segments, o, lse, do, dlse, *, interpret: bool = False):
  """The kernels' backward of one call without priors or skips at a given o and lse."""
  del k_positions, local_prior, skip_prior  # (the front door sends calls with them to xla)
  t = 1 if call.layout == "BTHK" else 2
  dq_pieces, dk, dv = [], jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32)
  for (qs, ql), pairs in _piece_pairs(call, call.pattern, interpret):
    rows = lambda x: _take(x, qs, ql, t)
    dq = jnp.zeros(rows(q).shape, F32)
    for (ks, kl), sub, spec in pairs:
      cols = lambda x: _take(x, ks, kl, t)
      _record(spec)
      fn = functools.partial(_backward_shard, spec, sub.scale, sub.layout)
      arrays, kinds = _kinds(
          (rows(q), "qkv"), (cols(k), "kv"), (cols(v), "kv"),
          (None if call.k_start is not None else k_start + ks, "replicated"),
          (_take(q_segments, qs, ql, 1), "ids"), (_take(k_segments, ks, kl, 1), "ids"),
          (rows(o), "qkv"), (rows(lse), "rows"), (rows(do), "qkv"), (rows(dlse), "rows"))
      g_q, g_k, g_v = kernel_mesh.per_shard(fn, arrays, kinds, ["qkv", "kv", "kv"],
                                            layout=call.layout)
      dq = dq + g_q.astype(F32)
      dk = jax.lax.dynamic_update_slice_in_dim(dk, cols(dk) + g_k.astype(F32), ks, axis=t)
      dv = jax.lax.dynamic_update_slice_in_dim(dv, cols(dv) + g_v.astype(F32), ks, axis=t)
    dq_pieces.append(dq)
  dq = jnp.concatenate(dq_pieces, axis=t) if len(dq_pieces) > 1 else dq_pieces[0]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


BACKEND = Backend(
    name="splash", attend=attend, backward=backward, unsupported=unsupported,
    pattern_unsupported=pattern_unsupported, platforms=("tpu",),
    doc="TPU: Pallas splash-attention kernels, one key interval per query from the Pattern")
