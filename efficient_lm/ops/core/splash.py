"""The `splash` backend: jax's Pallas TPU splash-attention kernels, masks from the `Pattern`.

Contract (`backends.Backend`): `attend(call, q, k, v, ...) -> (o, lse)`, differentiable in
q, k, v and the priors under cotangents on o and lse. `unsupported` names the calls it cannot
run, which the front door runs on `xla`: explicit key positions, a traced k_offset, an unknown
block phase, dtypes other than float32 / bfloat16, more than `MAX_KEYS` (65,408) keys in one
call. π's skips run beside the kernel (`skips.attend_with_skips`). `interpret=True` runs the
kernels in Pallas interpret mode (CPU tests).

Details (the interval mask, the cached block tables, the backward): docs/architecture.md,
"Attention core".
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as sinfo

from efficient_lm import jax_compat
from efficient_lm.ops.core import backends, kernel_mesh, skips
from efficient_lm.ops.core.plan import NO_KEY_LSE, cdiv
from efficient_lm.ops.pattern import Pattern

F32 = jnp.float32

# Kernel tiles: multiples of 128 (the kernels' lane width), shrunk to the call for short ones.
BLOCK_Q = 512
BLOCK_KV = 512
BLOCK_KV_COMPUTE = 512
LANES = 128
MAX_KEYS = (1 << 16) - LANES  # a key bound (0..padded Tk) must fit in 16 bits

DTYPES = ("float32", "bfloat16")
_MASK_VALUE = sk.DEFAULT_MASK_VALUE
_LAYOUT = sk.QKVLayout.HEAD_DIM_MINOR


# Which calls the kernel takes.

def pattern_unsupported(pattern: Pattern) -> str | None:
  """None: every `Pattern`'s local part is one key interval per query, and skips run beside."""
  del pattern
  return None


def _block(length: int, limit: int) -> int:
  """The kernel tile along a sequence of `length`: a multiple of 128, at most `limit`."""
  return min(limit, cdiv(length, LANES) * LANES)


def _padded(length: int, block: int) -> int:
  return cdiv(length, block) * block


def unsupported(call: backends.Call) -> str | None:
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
  if _padded(call.Tk, _block(call.Tk, BLOCK_KV)) > MAX_KEYS:
    return (f"Tk={call.Tk} keys in one call: the kernel's packed key bounds hold at most "
            f"{MAX_KEYS} (padded) keys")
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


def _forward(spec: _Spec, q, k, v, bounds):
  o, (lse,) = jax_compat.splash_forward(
      _info(_masks(spec).fwd, bounds), q, k, v, None, None, mask_value=_MASK_VALUE,
      is_mqa=False, block_sizes=spec.block_sizes, residual_checkpoint_name=None,
      save_residuals=True, mask_function=_interval_mask, interpret=spec.interpret)
  empty = _empty(bounds)  # the kernel leaves these rows undefined (NaN where no block ran)
  o = jnp.where(empty[None, :, None], 0, o).astype(q.dtype)
  return o, jnp.where(empty[None], NO_KEY_LSE, lse.astype(F32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _splash(spec: _Spec, q, k, v, bounds):
  return _forward(spec, q, k, v, bounds)


def _splash_fwd(spec: _Spec, q, k, v, bounds):
  o, lse = _forward(spec, q, k, v, bounds)
  return (o, lse), (q, k, v, bounds, o, lse)


def _splash_bwd(spec: _Spec, residuals, cotangents):
  q, k, v, bounds, o, lse = residuals
  do, dlse = cotangents
  do = do.astype(q.dtype)
  # Empty rows: every logit is the kernel's mask value, far below NO_KEY_LSE: p = 0 there.
  di = jnp.einsum("ntk,ntk->nt", o.astype(F32), do.astype(F32)) - dlse.astype(F32)
  masks = _masks(spec)
  common = dict(is_mqa=False, mask_value=_MASK_VALUE, attn_logits_soft_cap=None,
                q_layout=_LAYOUT, k_layout=_LAYOUT, v_layout=_LAYOUT,
                mask_function=_interval_mask, interpret=spec.interpret)
  sizes = spec.block_sizes
  _, dk, dv = jax_compat.splash_bwd_dkv(
      q, k, v, None, None, lse, do, di, bq=sizes.block_q_dkv, bkv=sizes.block_kv_dkv,
      bkv_compute=sizes.block_kv_dkv_compute, mask_info=_info(masks.dkv, bounds),
      use_fused_bwd_kernel=False, **common)
  dq = jax_compat.splash_bwd_dq(
      q, k, v, None, None, lse, do, di, bq=sizes.block_q_dq, bkv=sizes.block_kv_dq,
      mask_info=_info(masks.fwd, bounds), **common)
  return dq, dk, dv, None


_splash.defvjp(_splash_fwd, _splash_bwd)


# The backend.

def _pad_rows(x_NTK, length: int):
  return jnp.pad(x_NTK, [(0, 0), (0, length - x_NTK.shape[1]), (0, 0)])


def _local_shard(spec: _Spec, scale: float, layout: str, q, k, v, k_start):
  """The kernel's (o, lse) on one shard's arrays, in `layout` (lse: `[B, Tq, H]` / `[B, H, Tq]`)."""
  if layout == "BTHK":
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
  B, H = q.shape[:2]
  flat = lambda x, length: _pad_rows(x.reshape(B * H, *x.shape[2:]), length)
  q_NTK = flat((q * jnp.asarray(scale, q.dtype)).astype(q.dtype), spec.Tq_pad)
  k_NTK, v_NTK = (flat(x.astype(q.dtype), spec.Tk_pad) for x in (k, v))
  o_NTK, lse_NT = _splash(spec, q_NTK, k_NTK, v_NTK, _bounds(spec, k_start))
  o = o_NTK[:, :spec.Tq].reshape(B, H, spec.Tq, o_NTK.shape[-1])
  lse = lse_NT[:, :spec.Tq].reshape(B, H, spec.Tq)
  if layout == "BTHK":
    o, lse = jnp.swapaxes(o, 1, 2), jnp.swapaxes(lse, 1, 2)
  return o, lse


def _spec_for(call: backends.Call, pattern: Pattern, interpret: bool) -> _Spec:
  min_key = 0 if call.k_start is None else min(max(0, -call.k_start), call.Tk)
  return _Spec(pattern=pattern, Tq=call.Tq, Tk=call.Tk, k_offset=call.k_offset,
               phase=call.q_phase, min_key=min_key, bq=_block(call.Tq, BLOCK_Q),
               bkv=_block(call.Tk, BLOCK_KV), interpret=bool(interpret))


def _local_attend(call: backends.Call, q, k, v, k_start, interpret: bool):
  """(o, lse) of the call's local pattern, no priors, per shard."""
  spec = _spec_for(call, call.pattern.local, interpret)
  traced = None if call.k_start is not None else jnp.asarray(k_start, jnp.int32)
  fn = functools.partial(_local_shard, spec, call.scale, call.layout)
  return kernel_mesh.per_shard(fn, [q, k, v, traced],
                               ["qkv"] * 3 + ["replicated" if traced is not None else "none"],
                               ["qkv", "rows"], layout=call.layout)


def attend(call, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior, *,
           interpret: bool = False):
  del k_positions  # None: `unsupported` sends explicit positions to xla
  local = lambda q, k, v: _local_attend(call, q, k, v, k_start, interpret)
  if call.pattern.skips:
    return skips.attend_with_skips(local, call, q, k, v, q_start, local_prior, skip_prior)
  o, lse = local(q, k, v)
  if local_prior is not None:  # a constant on every logit of the row: lse moves, o does not
    lse = jnp.where(lse > NO_KEY_LSE, lse + local_prior.astype(F32), NO_KEY_LSE)
  return o, lse


backends.register(backends.Backend(
    name="splash", attend=attend, unsupported=unsupported, pattern_unsupported=pattern_unsupported,
    platforms=("tpu",),
    doc="TPU: Pallas splash-attention kernels, one key interval per query from the Pattern"))
