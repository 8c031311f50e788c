"""A kernel on the mesh: run a Pallas / custom-call kernel on each device's own rows and heads.

XLA cannot partition a kernel's custom call: traced under a mesh with the
batch split (`data`, `fsdp`) or the heads split (`tensor`), it would gather
whole arrays onto every device first (and Mosaic refuses to lower a kernel
under any axis left to the partitioner). `per_shard(fn, ...)` runs `fn`
inside a `jax.shard_map` over every mesh axis not already manual: the batch
over `data` x `fsdp`, the heads over `tensor`, replicated along the others,
so each device calls the kernel on its own batch rows and heads (attention
never mixes either). Axes already manual (inside the ring ops' own
`shard_map` over `context`) are left alone; without a mesh `fn` is called as
it is.

Grouped key/value heads (fewer than the query heads) split over the heads' axis like the
query heads when its size divides their number: each device's query heads then find their
groups' key/value heads on it. Otherwise (`mesh.rules.kv_heads=''`: k and v replicated) every
device holds them whole and takes the one its query heads share (`kv_heads_of`): that needs each
device's query heads inside one group.
"""

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")
HEAD_AXES = ("tensor",)


def _free_axes(mesh) -> tuple[str, ...]:
  """The mesh axes not already manual."""
  manual = jax.sharding.AxisType.Manual
  return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != manual)


def whole_kv_heads(q_heads: int, kv_heads: int, shards: int) -> bool:
  """Whether k / v stay whole on every device while `shards` devices split the q heads (k / v's
  heads then cannot split with them); ValueError when some device's query heads span two
  groups (then no single key/value head serves it)."""
  if shards == 1 or kv_heads == q_heads or kv_heads % shards == 0:
    return False
  local, group = q_heads // shards, q_heads // kv_heads
  if group % local:
    raise ValueError(f"{q_heads} query heads over {shards} devices ({local} each) with "
                     f"{kv_heads} key/value heads ({group} query heads each): a device's query "
                     "heads must share one key/value head, or the key/value heads split with "
                     f"them; make model.num_kv_heads a multiple of {shards} (mesh.rules.kv_heads"
                     "='tensor') or a divisor of model.num_heads / the tensor size")
  return True


def kv_heads_of(x: jax.Array, axis: int, q_heads: int, kv_heads: int, mesh_axis: str) -> jax.Array:
  """Inside a `shard_map` over `mesh_axis` (splitting the query heads), this device's key/value
  head of a whole k / v (`whole_kv_heads`): `[..., 1, ...]` on `axis`."""
  local = q_heads // jax.lax.axis_size(mesh_axis)
  first = jax.lax.axis_index(mesh_axis) * local // (q_heads // kv_heads)
  return jax.lax.dynamic_slice_in_dim(x, first, 1, axis)


def kv_heads_back(x: jax.Array, axis: int, q_heads: int, kv_heads: int,
                  mesh_axis: str) -> jax.Array:
  """The adjoint of `kv_heads_of`: a device's gradient of its one key/value head placed among
  the `kv_heads` and summed over the devices (the gradient of the whole k / v, on every one)."""
  local = q_heads // jax.lax.axis_size(mesh_axis)
  first = jax.lax.axis_index(mesh_axis) * local // (q_heads // kv_heads)
  shape = list(x.shape)
  shape[axis] = kv_heads
  placed = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(shape, x.dtype), x, first, axis)
  return jax.lax.psum(placed, mesh_axis)


def per_shard(fn: Callable, arrays: list, kinds: list[str], out_kinds: list[str], *,
              layout: str = "BTHK"):
  """`fn(*arrays)` on each device's rows and heads of the current mesh.

  `kinds` / `out_kinds` say what each input / output is: 'qkv' (`[B, T, H, K]`,
  or `[B, H, T, K]` for layout "BHTK"), 'kv' (k or v, or their gradients: the same with H_kv
  heads, which may be fewer), 'rows' (`[B, T, H]` / `[B, H, T]`: priors, lse), 'ids' (`[B, T]`:
  document ids), 'replicated' (traced scalars, small tables), or 'none' (a None argument,
  passed through).
  """
  mesh = jax.sharding.get_abstract_mesh()
  free = _free_axes(mesh) if not mesh.empty else ()
  if not free:
    return fn(*arrays)
  batch = tuple(a for a in BATCH_AXES if a in free and mesh.shape[a] > 1)
  heads = tuple(a for a in HEAD_AXES if a in free and mesh.shape[a] > 1)
  b = batch if len(batch) > 1 else (batch[0] if batch else None)
  h = heads[0] if heads else None
  heads_first = layout == "BHTK"
  axis = 1 if heads_first else 2  # the heads
  q_heads = next((x.shape[axis] for x, kind in zip(arrays, kinds) if kind == "qkv"), None)
  kv_heads = next((x.shape[axis] for x, kind in zip(arrays, kinds) if kind == "kv"), q_heads)
  whole = h is not None and whole_kv_heads(q_heads, kv_heads, mesh.shape[h])
  qkv = lambda h: P(b, h, None, None) if heads_first else P(b, None, h, None)
  specs = {"qkv": qkv(h), "kv": qkv(None if whole else h),
           "rows": P(b, h, None) if heads_first else P(b, None, h),
           "ids": P(b, None), "replicated": P(), "none": None}
  present = [i for i, kind in enumerate(kinds) if kind != "none"]

  def body(*given):
    full = [None] * len(arrays)
    for i, x in zip(present, given):
      full[i] = kv_heads_of(x, axis, q_heads, kv_heads, h) if whole and kinds[i] == "kv" else x
    outs = fn(*full)
    if not whole or "kv" not in out_kinds:
      return outs
    outs = list(outs) if len(out_kinds) > 1 else [outs]
    outs = [kv_heads_back(y, axis, q_heads, kv_heads, h) if kind == "kv" else y
            for y, kind in zip(outs, out_kinds)]
    return tuple(outs) if len(out_kinds) > 1 else outs[0]

  in_specs = tuple(specs[kinds[i]] for i in present)
  out_specs = tuple(specs[k] for k in out_kinds)
  mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                         out_specs=out_specs if len(out_specs) > 1 else out_specs[0],
                         axis_names=set(free), check_vma=False)
  return mapped(*[arrays[i] for i in present])
