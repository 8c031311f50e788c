"""The `gpu` backend: cuDNN where it fits, else our Pallas GPU (Triton) flash kernel.

Contract (`call.Backend`): `attend(call, q, k, v, ...) -> (o, lse)`, differentiable in
q, k, v and the priors under cotangents on o and lse; `backward` at a given o and lse (ring
steps).

- cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`, `cudnn.py`): causal or
  causal-window self-attention (static q_start == k_start >= 0, Tq == Tk), no lse wanted, no
  priors, no document ids, bfloat16 / float16, head width a multiple of 8 up to 128 (256 on
  compute capability 9.0+).
- The Pallas kernel: every other call with keys at `k_start + arange(Tk)` and a static
  `k_offset` (traced starts are fine). Its mask comes from the query / key positions and the
  `Pattern` inside the kernel (keys at negative positions are never visible), key blocks
  wholly outside a query block's `Pattern.key_range` are skipped; forward with lse, backward
  dq and dk / dv with the lse cotangent entering as `delta - dlse`. π: the window through the
  kernel, the skips beside it (`skips.kernel_attend`); priors shift lse outside it.
  Document ids are one more comparison in the kernel's mask.
- `xla` (via `unsupported`): explicit key positions (decoding caches), a traced k_offset.

Grouped-query attention (k, v with fewer heads): cuDNN groups the query heads itself; the
kernel's forward and dq read query head h's key/value head h // G through the block index
map, its dk / dv kernel runs once per key/value head over the G query heads of its group.

`interpret=True` runs the Pallas kernels in Pallas interpret mode (CPU tests). cuDNN cannot
be interpreted, so interpreted calls never take the cuDNN path: the kernel serves them too.
Every kernel call runs per shard (`kernel_mesh.per_shard`).
"""

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from efficient_lm.ops.core import cudnn, kernel_mesh, skips
from efficient_lm.ops.core.call import KERNEL_CALLS, Backend, Call
from efficient_lm.ops.core.plan import MASKED, NO_KEY_LSE, cdiv
from efficient_lm.ops.core.cudnn import target_capability
from efficient_lm.ops.pattern import Pattern

F32 = jnp.float32
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# Kernel tiles (queries x keys), for the forward and both backward kernels. Powers of two, at
# least 16 (Triton's smallest dot); shrunk to the sequence for short calls.
BLOCK_Q = 64
BLOCK_K = 64
ROW_BYTES = 512  # tiles shrink by the factor a q / v row is wider than this (f32 K=256: 32 x 32)
NUM_STAGES = 2

log = logging.getLogger(__name__)
_refusals_logged: set = set()

CUDNN_DTYPES = ("bfloat16", "float16")
KERNEL_DTYPES = ("float32", "bfloat16", "float16")


# Which backend part serves a call.

def unsupported(call: Call) -> str | None:
  """Why the gpu backend cannot run `call` (the front door then runs `xla`), or None."""
  if call.explicit:
    return "explicit key positions (decoding caches): the kernel places keys at k_start + arange(Tk)"
  if call.k_offset is None:
    return "a traced key offset (ring steps): the kernel needs k_start - q_start static"
  if call.dtype not in KERNEL_DTYPES:
    return f"dtype {call.dtype}: the kernel takes {', '.join(KERNEL_DTYPES)}"
  return None


def pattern_unsupported(pattern: Pattern) -> str | None:
  """None: the kernel's mask is `Pattern.local_visible` itself, and π's skips run beside it."""
  del pattern
  return None


def _takes_cudnn(call: Call, q, v, interpret: bool) -> bool:
  pattern = call.pattern
  if interpret or pattern.has_skips or pattern.block_size is not None or not pattern.causal:
    return False
  if call.segments:
    _log_once("attention on the Pallas kernel instead of cuDNN: document ids (cuDNN's packed "
              "sequences need a static count of documents per row)")
    return False
  if call.with_lse or call.local_prior or call.skip_prior or call.dtype not in CUDNN_DTYPES:
    return False
  if call.q_start is None or call.k_start != call.q_start or call.q_start < 0 or call.Tq != call.Tk:
    return False
  width = q.shape[-1]
  capability = target_capability() or (0, 0)
  return v.shape[-1] == width and width % 8 == 0 and width <= (256 if capability >= (9, 0) else 128)


def _log_once(message: str) -> None:
  if message not in _refusals_logged:
    _refusals_logged.add(message)
    log.info("%s", message)


_cudnn_attend = cudnn.attend  # (a module global: the tests replace it)


def attend(call, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior, q_segments,
           k_segments, *, interpret: bool = False):
  del k_start, k_positions  # k_start = q_start + call.k_offset; explicit positions run on xla
  if _takes_cudnn(call, q, v, interpret):
    try:  # jax's own checks (cuDNN version, head width) run while the call traces
      o = _cudnn_attend(call, q, k, v)
      KERNEL_CALLS[("gpu", "cudnn")] += 1
      return o, None
    except NotImplementedError as refusal:
      _log_once(f"attention on the Pallas kernel instead of cuDNN: {refusal}")
    except RuntimeError as missing:  # jax asks for cuDNN's version: no cuDNN library installed
      if "cudnn" not in str(missing).lower():
        raise
      _log_once(f"attention on the Pallas kernel instead of cuDNN ({missing}: install "
                "nvidia-cudnn-cu12, which jax[cuda12] brings, to use it)")
  local = lambda q, k, v: _kernel_attend(call, q, k, v, q_start, q_segments, k_segments, interpret)
  return skips.kernel_attend(local, call, q, k, v, q_start, local_prior, skip_prior, q_segments,
                             k_segments)


# The Pallas kernel: block ranges from the pattern.

@dataclasses.dataclass(frozen=True)
class _Kernel:
  """What is static about one kernel call (hashable: the custom VJP's static argument)."""
  pattern: Pattern  # local (no skips)
  scale: float
  Tq: int
  Tk: int
  k_offset: int     # k_start - q_start
  layout: str
  block_q: int
  block_k: int
  interpret: bool
  segments: bool = False  # document ids: two more inputs, one more mask comparison
  groups: int = 1         # query heads per key/value head (grouped-query attention)

  @property
  def Tq_padded(self) -> int:
    return cdiv(self.Tq, self.block_q) * self.block_q

  @property
  def Tk_padded(self) -> int:
    return cdiv(self.Tk, self.block_k) * self.block_k


def _query_range(pattern: Pattern, k_first, k_last):
  """(lowest, highest) query position that may see a key in [k_first, k_last] (k_first >= 0);
  None where unbounded. The inverse of `Pattern.key_range` (local patterns)."""
  lo = k_first if pattern.causal else None
  hi = None if pattern.window is None else k_last + pattern.window - 1
  if pattern.block_size is not None:
    size = pattern.block_size
    block_lo = (k_first // size) * size
    block_hi = (k_last // size + pattern.lookback + 1) * size - 1
    lo = block_lo if lo is None else jnp.maximum(lo, block_lo)
    hi = block_hi if hi is None else jnp.minimum(hi, block_hi)
  return lo, hi


def _key_blocks(kern: _Kernel, q_start, i):
  """[start, stop) of the key blocks query block i may see (`Pattern.key_range`)."""
  k_start = q_start + kern.k_offset
  first = q_start + i * kern.block_q
  last = q_start + jnp.minimum((i + 1) * kern.block_q, kern.Tq) - 1
  lo, hi = kern.pattern.key_range(first, last)
  lo_index = jnp.maximum(lo - k_start, 0)
  hi_index = kern.Tk - 1 if hi is None else jnp.minimum(hi - k_start, kern.Tk - 1)
  start = lo_index // kern.block_k
  return start, jnp.where(hi_index >= lo_index, hi_index // kern.block_k + 1, start)


def _query_blocks(kern: _Kernel, q_start, j):
  """[start, stop) of the query blocks that may see key block j (`_query_range`)."""
  k_start = q_start + kern.k_offset
  k_first = jnp.maximum(k_start + j * kern.block_k, 0)  # keys at negative positions: unseen
  k_last = k_start + jnp.minimum((j + 1) * kern.block_k, kern.Tk) - 1
  lo, hi = _query_range(kern.pattern, k_first, k_last)
  lo_index = 0 if lo is None else jnp.maximum(lo - q_start, 0)
  hi_index = kern.Tq - 1 if hi is None else jnp.minimum(hi - q_start, kern.Tq - 1)
  start = lo_index // kern.block_q
  some = (hi_index >= lo_index) & (k_last >= k_first)
  return start, jnp.where(some, hi_index // kern.block_q + 1, start)


# The Pallas kernel: the three kernels (refs are one batch row and head: [T, K] and [T]).

def _dot(a, b, *, t_a=False, t_b=False):
  """a @ b in float32, a / b transposed when asked (the contraction picks the axes)."""
  dims = (((0 if t_a else 1,), (1 if t_b else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=F32)


def _logits(kern: _Kernel, q, k, q_start, i, j, q_ids=None, k_ids=None):
  """Base-2 logits (scale * log2 e * q.k) of query block i against key block j, MASKED where
  unseen, and the mask (the pattern on positions, the document ids when given; padding rows and
  keys unseen)."""
  q_index = i * kern.block_q + jnp.arange(kern.block_q, dtype=jnp.int32)
  k_index = j * kern.block_k + jnp.arange(kern.block_k, dtype=jnp.int32)
  q_pos, k_pos = q_start + q_index, q_start + kern.k_offset + k_index
  seen = kern.pattern.local_visible(q_pos[:, None], k_pos[None, :])
  seen &= (q_index < kern.Tq)[:, None] & (k_index < kern.Tk)[None, :]
  if q_ids is not None:
    seen &= q_ids[:, None] == k_ids[None, :]
  s = _dot(q, k, t_b=True) * (kern.scale * LOG2E)
  return jnp.where(seen, s, MASKED), seen


def _split_refs(kern: _Kernel, refs, outputs: int):
  """(document-id refs or (None, None), output refs) of a kernel's trailing refs."""
  if kern.segments:
    return refs[:2], refs[2:]
  return (None, None), refs[-outputs:]


def _forward_kernel(start_ref, q_ref, k_ref, v_ref, *refs, kern: _Kernel):
  (qid_ref, kid_ref), (o_ref, lse_ref) = _split_refs(kern, refs, 2)
  i = pl.program_id(0)
  q_start = start_ref[0]
  q = q_ref[...]
  q_ids = None if qid_ref is None else qid_ref[...]

  def visit(j, carry):
    acc, peak, total = carry
    keys = pl.ds(j * kern.block_k, kern.block_k)
    v = v_ref[keys, :]
    k_ids = None if kid_ref is None else kid_ref[keys]
    s, seen = _logits(kern, q, k_ref[keys, :], q_start, i, j, q_ids, k_ids)
    new_peak = jnp.maximum(peak, jnp.max(s, axis=1))
    rescale = jnp.exp2(peak - new_peak)
    p = jnp.where(seen, jnp.exp2(s - new_peak[:, None]), 0.0)
    total = rescale * total + jnp.sum(p, axis=1)
    acc = rescale[:, None] * acc + _dot(p.astype(v.dtype), v)
    return acc, new_peak, total

  start, stop = _key_blocks(kern, q_start, i)
  init = (jnp.zeros(o_ref.shape, F32), jnp.full((kern.block_q,), MASKED, F32),
          jnp.zeros((kern.block_q,), F32))
  acc, peak, total = jax.lax.fori_loop(start, stop, visit, init)
  safe = jnp.where(total > 0, total, 1.0)
  o_ref[...] = (acc / safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(total > 0, (peak + jnp.log2(safe)) * LN2, NO_KEY_LSE)


def _dq_kernel(start_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
               kern: _Kernel):
  (qid_ref, kid_ref), (dq_ref,) = _split_refs(kern, refs, 1)
  i = pl.program_id(0)
  q_start = start_ref[0]
  q, do = q_ref[...], do_ref[...]
  lse2, delta = lse_ref[...] * LOG2E, delta_ref[...]
  q_ids = None if qid_ref is None else qid_ref[...]

  def visit(j, dq):
    keys = pl.ds(j * kern.block_k, kern.block_k)
    k = k_ref[keys, :]
    k_ids = None if kid_ref is None else kid_ref[keys]
    s, seen = _logits(kern, q, k, q_start, i, j, q_ids, k_ids)
    p = jnp.where(seen, jnp.exp2(s - lse2[:, None]), 0.0)
    ds = p * (_dot(do, v_ref[keys, :], t_b=True) - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  start, stop = _key_blocks(kern, q_start, i)
  dq = jax.lax.fori_loop(start, stop, visit, jnp.zeros(dq_ref.shape, F32))
  dq_ref[...] = (dq * kern.scale).astype(dq_ref.dtype)


def _member(kern: _Kernel, ref, rows, g: int):
  """Query block `rows` of a query-side ref of the dk / dv kernel: its one head, or member g of
  its group's block of `kern.groups` heads."""
  if kern.groups == 1:
    return ref[rows, :] if len(ref.shape) == 2 else ref[rows]
  at = (rows, g) if kern.layout == "BTHK" else (g, rows)
  return ref[(*at, slice(None))] if len(ref.shape) == 3 else ref[at]


def _dkv_kernel(start_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
                kern: _Kernel):
  (qid_ref, kid_ref), (dk_ref, dv_ref) = _split_refs(kern, refs, 2)
  j = pl.program_id(0)
  q_start = start_ref[0]
  k, v = k_ref[...], v_ref[...]
  k_ids = None if kid_ref is None else kid_ref[...]

  def visit(i, carry):
    dk, dv = carry
    rows = pl.ds(i * kern.block_q, kern.block_q)
    for g in range(kern.groups):  # the query heads of this key/value head (one without groups)
      q, do = _member(kern, q_ref, rows, g), _member(kern, do_ref, rows, g)
      q_ids = None if qid_ref is None else qid_ref[rows]
      s, seen = _logits(kern, q, k, q_start, i, j, q_ids, k_ids)
      p = jnp.where(seen, jnp.exp2(s - (_member(kern, lse_ref, rows, g) * LOG2E)[:, None]), 0.0)
      dv = dv + _dot(p.astype(do.dtype), do, t_a=True)
      ds = p * (_dot(do, v, t_b=True) - _member(kern, delta_ref, rows, g)[:, None])
      dk = dk + _dot(ds.astype(q.dtype), q, t_a=True)
    return dk, dv

  start, stop = _query_blocks(kern, q_start, j)
  dk, dv = jax.lax.fori_loop(start, stop, visit,
                             (jnp.zeros(dk_ref.shape, F32), jnp.zeros(dv_ref.shape, F32)))
  dk_ref[...] = (dk * kern.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# The Pallas kernel: calls (padding, block specs, the custom VJP).

def _width(d: int) -> int:
  """A head width as the kernel holds it: a power of two, at least 16."""
  return max(16, pl.next_power_of_2(d))


def _pad(x, t_axis: int, length: int, width: int | None = None):
  """x zero-padded along its T axis to `length` (and its last axis to `width`)."""
  pad = [(0, 0)] * x.ndim
  pad[t_axis] = (0, length - x.shape[t_axis])
  if width is not None:
    pad[-1] = (0, width - x.shape[-1])
  return x if all(p == (0, 0) for p in pad) else jnp.pad(x, pad)


def _spec(kern: _Kernel, kind: str, length: int, width: int = 0, *, whole: bool = False,
          heads: str = "own"):
  """The BlockSpec of a 'qkv' operand ([B, T, H, width] / [B, H, T, width]), a 'rows' one
  ([B, T, H] / [B, H, T]) or an 'ids' one ([B, T]) on the grid (T blocks, B, heads): `length`
  positions along T, at the grid's block along T, or from 0 when `whole`. Grouped heads:
  `heads='kv'`, k / v on a grid over query heads (h reads h // groups); `heads='group'`, a query
  operand on a grid over kv heads (its group's `groups` heads, one more block axis)."""
  t = (lambda i: 0) if whole else (lambda i: i)
  if kind == "ids":
    return pl.BlockSpec((None, length), lambda i, b, h: (b, t(i)))
  grouped = kern.groups > 1
  at = (lambda h: h // kern.groups) if grouped and heads == "kv" else (lambda h: h)
  n = kern.groups if grouped and heads == "group" else None
  if kern.layout == "BHTK":
    if kind == "qkv":
      return pl.BlockSpec((None, n, length, width), lambda i, b, h: (b, at(h), t(i), 0))
    return pl.BlockSpec((None, n, length), lambda i, b, h: (b, at(h), t(i)))
  if kind == "qkv":
    return pl.BlockSpec((None, length, n, width), lambda i, b, h: (b, t(i), at(h), 0))
  return pl.BlockSpec((None, length, n), lambda i, b, h: (b, t(i), at(h)))


def _grid(kern: _Kernel, x, blocks: int) -> tuple[int, int, int]:
  heads = x.shape[1] if kern.layout == "BHTK" else x.shape[2]
  return (blocks, x.shape[0], heads)


def _rows_shape(kern: _Kernel, x, length: int) -> tuple[int, int, int]:
  B, H = x.shape[0], x.shape[1] if kern.layout == "BHTK" else x.shape[2]
  return (B, H, length) if kern.layout == "BHTK" else (B, length, H)


def _call(kern: _Kernel, body, grid, in_specs, out_specs, out_shape, width: int, name: str):
  return pl.pallas_call(
      functools.partial(body, kern=kern), grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=kern.interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=4 if width <= 64 else 8,
                                           num_stages=NUM_STAGES))


_START = pl.BlockSpec((1,), lambda i, b, h: (0,))
_KV = dict(whole=True, heads="kv")  # k / v whole, on a grid over the query heads


def _ids(kern: _Kernel, qseg, kseg, q_whole: bool, k_whole: bool):
  """The document-id operands (padded: queries -1, keys -2) and their BlockSpecs, or nothing."""
  if not kern.segments:
    return [], []
  pad = lambda x, n, fill: jnp.pad(x, [(0, 0), (0, n - x.shape[1])], constant_values=fill)
  arrays = [pad(qseg, kern.Tq_padded, -1), pad(kseg, kern.Tk_padded, -2)]
  specs = [_spec(kern, "ids", kern.Tq_padded if q_whole else kern.block_q, whole=q_whole),
           _spec(kern, "ids", kern.Tk_padded if k_whole else kern.block_k, whole=k_whole)]
  return arrays, specs


def _forward(kern: _Kernel, q, k, v, start, qseg=None, kseg=None):
  t = 1 if kern.layout == "BTHK" else 2
  Tq, Tk, Kq, Kv = kern.Tq_padded, kern.Tk_padded, _width(q.shape[-1]), _width(v.shape[-1])
  q_p, k_p, v_p = _pad(q, t, Tq, Kq), _pad(k, t, Tk, Kq), _pad(v, t, Tk, Kv)
  ids, id_specs = _ids(kern, qseg, kseg, q_whole=False, k_whole=True)
  o_p, lse_p = _call(
      kern, _forward_kernel, _grid(kern, q, Tq // kern.block_q),
      [_START, _spec(kern, "qkv", kern.block_q, Kq), _spec(kern, "qkv", Tk, Kq, **_KV),
       _spec(kern, "qkv", Tk, Kv, **_KV), *id_specs],
      [_spec(kern, "qkv", kern.block_q, Kv), _spec(kern, "rows", kern.block_q)],
      [jax.ShapeDtypeStruct(q_p.shape[:3] + (Kv,), q.dtype),
       jax.ShapeDtypeStruct(_rows_shape(kern, q, Tq), F32)],
      max(Kq, Kv), "gpu_attention_forward")(start, q_p, k_p, v_p, *ids)
  o = jax.lax.slice_in_dim(o_p, 0, kern.Tq, axis=t)[..., :v.shape[-1]]
  return o, jax.lax.slice_in_dim(lse_p, 0, kern.Tq, axis=t)


def _backward(kern: _Kernel, q, k, v, start, o, lse, do, dlse, qseg=None, kseg=None):
  t = 1 if kern.layout == "BTHK" else 2
  Tq, Tk, Kq, Kv = kern.Tq_padded, kern.Tk_padded, _width(q.shape[-1]), _width(v.shape[-1])
  # d lse_i / d s_ij = p_ij, so the lse cotangent joins delta_i = <do_i, o_i>: ds = p (dp - delta + dlse).
  delta = jnp.sum(o.astype(F32) * do.astype(F32), axis=-1) - dlse.astype(F32)
  q_p, k_p, v_p = _pad(q, t, Tq, Kq), _pad(k, t, Tk, Kq), _pad(v, t, Tk, Kv)
  do_p = _pad(do.astype(o.dtype), t, Tq, Kv)
  lse_p, delta_p = _pad(lse, t, Tq), _pad(delta, t, Tq)
  width = max(Kq, Kv)
  ids, id_specs = _ids(kern, qseg, kseg, q_whole=False, k_whole=True)
  dq = _call(
      kern, _dq_kernel, _grid(kern, q, Tq // kern.block_q),
      [_START, _spec(kern, "qkv", kern.block_q, Kq), _spec(kern, "qkv", Tk, Kq, **_KV),
       _spec(kern, "qkv", Tk, Kv, **_KV), _spec(kern, "qkv", kern.block_q, Kv),
       _spec(kern, "rows", kern.block_q), _spec(kern, "rows", kern.block_q), *id_specs],
      _spec(kern, "qkv", kern.block_q, Kq), jax.ShapeDtypeStruct(q_p.shape, q.dtype), width,
      "gpu_attention_dq")(start, q_p, k_p, v_p, do_p, lse_p, delta_p, *ids)
  ids, id_specs = _ids(kern, qseg, kseg, q_whole=True, k_whole=False)
  group = dict(whole=True, heads="group")  # the grid runs over k's heads
  dk, dv = _call(
      kern, _dkv_kernel, _grid(kern, k, Tk // kern.block_k),
      [_START, _spec(kern, "qkv", Tq, Kq, **group), _spec(kern, "qkv", kern.block_k, Kq),
       _spec(kern, "qkv", kern.block_k, Kv), _spec(kern, "qkv", Tq, Kv, **group),
       _spec(kern, "rows", Tq, **group), _spec(kern, "rows", Tq, **group), *id_specs],
      [_spec(kern, "qkv", kern.block_k, Kq), _spec(kern, "qkv", kern.block_k, Kv)],
      [jax.ShapeDtypeStruct(k_p.shape, k.dtype), jax.ShapeDtypeStruct(v_p.shape, v.dtype)], width,
      "gpu_attention_dkv")(start, q_p, k_p, v_p, do_p, lse_p, delta_p, *ids)
  unpad = lambda x, n, d: jax.lax.slice_in_dim(x, 0, n, axis=t)[..., :d]
  return (unpad(dq, kern.Tq, q.shape[-1]), unpad(dk, kern.Tk, k.shape[-1]),
          unpad(dv, kern.Tk, v.shape[-1]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(kern: _Kernel, q, k, v, start, qseg=None, kseg=None):
  return _forward(kern, q, k, v, start, qseg, kseg)


def _flash_fwd(kern: _Kernel, q, k, v, start, qseg=None, kseg=None):
  o, lse = _forward(kern, q, k, v, start, qseg, kseg)
  return (o, lse), (q, k, v, start, qseg, kseg, o, lse)


def _flash_bwd(kern: _Kernel, residuals, cotangents):
  q, k, v, start, qseg, kseg, o, lse = residuals
  do, dlse = cotangents
  dq, dk, dv = _backward(kern, q, k, v, start, o, lse, do, dlse, qseg, kseg)
  return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _block(limit: int, length: int, row_bytes: int) -> int:
  """A tile length: `limit`, smaller for rows over ROW_BYTES (shared memory), at most the
  sequence (a power of two, at least 16)."""
  limit = limit * ROW_BYTES // max(ROW_BYTES, pl.next_power_of_2(row_bytes))
  return max(16, min(limit, pl.next_power_of_2(length)))


def tile(pattern: Pattern) -> int:
  """The kernel's tile limit for `pattern`: its local reach rounded up to a power of two, between
  16 (Triton's smallest dot) and `BLOCK_Q`."""
  reach = pattern.local.reach
  return BLOCK_Q if reach is None else min(BLOCK_Q, max(16, 1 << reach.bit_length()))


def _kernel_for(call: Call, q, k, v, pattern: Pattern, interpret: bool) -> _Kernel:
  row_bytes = max(q.shape[-1], v.shape[-1]) * jnp.dtype(q.dtype).itemsize
  size = tile(pattern)
  h = 2 if call.layout == "BTHK" else 1  # the heads axis
  kern = _Kernel(pattern=pattern, scale=call.scale, Tq=call.Tq, Tk=call.Tk,
                 k_offset=call.k_offset, layout=call.layout,
                 block_q=_block(min(BLOCK_Q, size), call.Tq, row_bytes),
                 block_k=_block(min(BLOCK_K, size), call.Tk, row_bytes), interpret=interpret,
                 segments=call.segments, groups=q.shape[h] // k.shape[h])
  KERNEL_CALLS[("gpu", f"triton {kern.block_q}x{kern.block_k} tiles")] += 1
  return kern


def _operands(*arrays_and_kinds):
  """(arrays, kinds) for `kernel_mesh.per_shard`, absent document ids dropped."""
  present = [(a, kind) for a, kind in arrays_and_kinds if a is not None]
  return [a for a, _ in present], [kind for _, kind in present]


def _kernel_attend(call: Call, q, k, v, q_start, qseg, kseg, interpret: bool):
  """(o, lse) of `call.pattern.local` on the Pallas kernel (no priors), per shard."""
  kern = _kernel_for(call, q, k, v, call.pattern.local, interpret)
  start = jnp.reshape(jnp.asarray(q_start, jnp.int32), (1,))
  arrays, kinds = _operands((q, "qkv"), (k, "kv"), (v, "kv"), (start, "replicated"),
                            (qseg, "ids"), (kseg, "ids"))
  return kernel_mesh.per_shard(functools.partial(_flash, kern), arrays, kinds, ["qkv", "rows"],
                               layout=call.layout)


def backward(call, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior, q_segments,
             k_segments, o, lse, do, dlse, *, interpret: bool = False):
  """The kernel's backward of one call without priors or skips at a given o and lse."""
  del k_start, k_positions, local_prior, skip_prior  # (the front door sends calls with them to xla)
  kern = _kernel_for(call, q, k, v, call.pattern, interpret)
  start = jnp.reshape(jnp.asarray(q_start, jnp.int32), (1,))

  def grads(q, k, v, start, o, lse, do, dlse, *ids):
    return _backward(kern, q, k, v, start, o, lse, do, dlse, *ids)

  arrays, kinds = _operands((q, "qkv"), (k, "kv"), (v, "kv"), (start, "replicated"),
                            (o, "qkv"), (lse, "rows"), (do, "qkv"), (dlse, "rows"),
                            (q_segments, "ids"), (k_segments, "ids"))
  dq, dk, dv = kernel_mesh.per_shard(grads, arrays, kinds, ["qkv", "kv", "kv"],
                                     layout=call.layout)
  return dq, dk, dv, None, None


BACKEND = Backend(
    name="gpu", attend=attend, backward=backward, unsupported=unsupported,
    pattern_unsupported=pattern_unsupported, platforms=("gpu",),
    doc="GPU: cuDNN for causal / window self-attention without lse, else a Pallas (Triton) "
        "flash kernel masked from the Pattern; decoding caches and traced key offsets on xla")
