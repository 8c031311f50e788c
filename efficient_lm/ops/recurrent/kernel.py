"""The gated delta rule's scan of the state across chunks as a Pallas TPU (Mosaic) kernel,
forward and backward (`impl='pallas'`).

The chunked form (`chunked.py`) does its `[C, C]` work for every chunk at once, as batched
matmuls; what stays sequential is

    entering_n = S;   S <- gamma_n S + Kd_n^T (U'_n - W_n S)       (n = 0 .. N-1)

which `lax.scan` runs as N small steps, each reading and writing the `[K, V]` state through
memory. Here one kernel walks the chunks of a (batch row, head) in order (the grid's last axis,
"arbitrary"), the state held in VMEM; rows and heads are independent grid points ("parallel").
The backward kernel walks the chunks in reverse with the state's cotangent dX in VMEM:

    new = U' - W S;   dU' = Kd dX;   dKd = new dX^T;   dW = -dU' S^T;   dgamma = sum(S * dX)
    dX <- gamma dX - W^T dU' + d(entering_n)

(S the state entering chunk n, kept by the forward pass; W^T and Kd^T are passed transposed so
that every matmul in the kernels is a plain or an rhs-transposed one.) Off a TPU the kernels run
only in Pallas interpret mode (`interpret=True`: tests). Under a mesh with the batch or the
heads split, each device runs the kernel on its own rows and heads (`jax.shard_map`, as
`ops.core.kernel_mesh.per_shard` does for attention).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from efficient_lm.ops import precision
from efficient_lm.ops.core import kernel_mesh
from efficient_lm.ops.recurrent.chunked import Chunks

F32 = jnp.float32
PLATFORMS = ("tpu",)


def check(interpret: bool) -> None:
  """ValueError where the kernel cannot run: off a TPU, and not interpreted."""
  platform = precision.platform()
  if platform not in PLATFORMS and not interpret:
    raise ValueError(f"impl='pallas' runs the gated delta rule's state scan as a TPU (Mosaic) "
                     f"kernel; this platform is {platform!r}: use impl='xla', or interpret=True "
                     "(Pallas interpret mode: slow, for tests)")


def _dot(a, b):
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32)


def _dot_t(a, b):
  """a @ b^T."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def _forward_kernel(w_ref, u_ref, kdT_ref, decay_ref, s0_ref, entering_ref, final_ref, S_ref):
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    S_ref[...] = s0_ref[...]

  S_KV = S_ref[...]
  entering_ref[...] = S_KV
  new_CV = u_ref[...] - _dot(w_ref[...], S_KV)
  S_KV = decay_ref[...] * S_KV + _dot(kdT_ref[...], new_CV)
  S_ref[...] = S_KV

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    final_ref[...] = S_KV


def _backward_kernel(w_ref, wT_ref, u_ref, kd_ref, decay_ref, S_ref, d_entering_ref, d_final_ref,
                     dw_ref, du_ref, dkd_ref, ddecay_ref, d_s0_ref, dX_ref):
  n = pl.program_id(2)

  @pl.when(n == 0)  # the last chunk
  def _():
    dX_ref[...] = d_final_ref[...]

  S_KV, dX_KV = S_ref[...], dX_ref[...]
  new_CV = u_ref[...] - _dot(w_ref[...], S_KV)
  dnew_CV = _dot(kd_ref[...], dX_KV)
  du_ref[...] = dnew_CV
  dkd_ref[...] = _dot_t(new_CV, dX_KV)
  dw_ref[...] = -_dot_t(dnew_CV, S_KV)
  ddecay_ref[...] = jnp.sum(S_KV * dX_KV, axis=0, keepdims=True)
  dX_KV = decay_ref[...] * dX_KV - _dot(wT_ref[...], dnew_CV) + d_entering_ref[...]
  dX_ref[...] = dX_KV

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    d_s0_ref[...] = dX_KV


def _chunk_spec(shape, reverse: bool, N: int):
  """`[N, B, H, a, b]` arrays, one chunk's `[a, b]` block per grid point (b, h, n)."""
  chunk = (lambda n: N - 1 - n) if reverse else (lambda n: n)
  return pl.BlockSpec((None, None, None, *shape), lambda b, h, n: (chunk(n), b, h, 0, 0))


def _state_spec(K: int, V: int):
  return pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0))


def _call(kernel, grid, in_specs, out_specs, out_shape, scratch, interpret: bool, name: str):
  """The kernel as a `pallas_call` named `name` (the compile report's kernel names)."""
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, name=name,
      scratch_shapes=[pltpu.VMEM(scratch, F32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret)


def _forward(interpret: bool, chunks: Chunks, state_BHKV):
  w, u, kd, decay = chunks
  N, B, H, C, K = w.shape
  V = u.shape[-1]
  row_NBH1V = jnp.broadcast_to(decay[..., None, None], (N, B, H, 1, V))
  spec = functools.partial(_chunk_spec, reverse=False, N=N)
  return _call(
      _forward_kernel, (B, H, N),
      [spec((C, K)), spec((C, V)), spec((K, C)), spec((1, V)), _state_spec(K, V)],
      [spec((K, V)), _state_spec(K, V)],
      [jax.ShapeDtypeStruct((N, B, H, K, V), F32), jax.ShapeDtypeStruct((B, H, K, V), F32)],
      (K, V), interpret, "gated_delta_state_scan_fwd")(w, u, jnp.swapaxes(kd, -1, -2), row_NBH1V,
                                                       state_BHKV)


def _backward(interpret: bool, chunks: Chunks, entering_NBHKV, d_entering_NBHKV, d_final_BHKV):
  w, u, kd, decay = chunks
  N, B, H, C, K = w.shape
  V = u.shape[-1]
  row_NBH1V = jnp.broadcast_to(decay[..., None, None], (N, B, H, 1, V))
  spec = functools.partial(_chunk_spec, reverse=True, N=N)
  dw, du, dkd, ddecay_NBH1V, d_state = _call(
      _backward_kernel, (B, H, N),
      [spec((C, K)), spec((K, C)), spec((C, V)), spec((C, K)), spec((1, V)), spec((K, V)),
       spec((K, V)), _state_spec(K, V)],
      [spec((C, K)), spec((C, V)), spec((C, K)), spec((1, V)), _state_spec(K, V)],
      [jax.ShapeDtypeStruct(w.shape, F32), jax.ShapeDtypeStruct(u.shape, F32),
       jax.ShapeDtypeStruct(kd.shape, F32), jax.ShapeDtypeStruct((N, B, H, 1, V), F32),
       jax.ShapeDtypeStruct((B, H, K, V), F32)],
      (K, V), interpret, "gated_delta_state_scan_bwd")(w, jnp.swapaxes(w, -1, -2), u, kd,
                                                       row_NBH1V, entering_NBHKV,
                                                       d_entering_NBHKV, d_final_BHKV)
  return Chunks(dw, du, dkd, jnp.sum(ddecay_NBH1V, axis=(-2, -1))), d_state


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan(interpret: bool, chunks: Chunks, state_BHKV):
  return tuple(_forward(interpret, chunks, state_BHKV))


def _scan_fwd(interpret: bool, chunks: Chunks, state_BHKV):
  entering_NBHKV, final_BHKV = _forward(interpret, chunks, state_BHKV)
  return (entering_NBHKV, final_BHKV), (chunks, entering_NBHKV)


def _scan_bwd(interpret: bool, residuals, cotangents):
  chunks, entering_NBHKV = residuals
  d_entering_NBHKV, d_final_BHKV = cotangents
  return _backward(interpret, chunks, entering_NBHKV, d_entering_NBHKV, d_final_BHKV)


_scan.defvjp(_scan_fwd, _scan_bwd)


def state_scan_fn(interpret: bool):
  """`chunked.state_scan`'s twin: (chunks, state) -> (entering states, final state), by the
  kernels, per shard of the batch and heads under a mesh."""
  check(interpret)

  def scan(chunks: Chunks, state_BHKV):
    mesh = jax.sharding.get_abstract_mesh()
    # pylint: disable-next=protected-access
    free = kernel_mesh._free_axes(mesh) if not mesh.empty else ()
    if not free:
      return _scan(interpret, chunks, state_BHKV)
    batch = tuple(a for a in kernel_mesh.BATCH_AXES if a in free and mesh.shape[a] > 1) or None
    heads = next((a for a in kernel_mesh.HEAD_AXES if a in free and mesh.shape[a] > 1), None)
    chunk_spec, state_spec = P(None, batch, heads), P(batch, heads)
    return jax.shard_map(functools.partial(_scan, interpret), mesh=mesh,
                         in_specs=(Chunks(*[chunk_spec] * 4), state_spec),
                         out_specs=(chunk_spec, state_spec), axis_names=set(free),
                         check_vma=False)(chunks, state_BHKV)

  return scan
