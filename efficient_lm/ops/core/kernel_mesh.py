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
"""

from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")
HEAD_AXES = ("tensor",)


def _free_axes(mesh) -> tuple[str, ...]:
  """The mesh axes not already manual."""
  manual = jax.sharding.AxisType.Manual
  return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != manual)


def per_shard(fn: Callable, arrays: list, kinds: list[str], out_kinds: list[str], *,
              layout: str = "BTHK"):
  """`fn(*arrays)` on each device's rows and heads of the current mesh.

  `kinds` / `out_kinds` say what each input / output is: 'qkv' (`[B, T, H, K]`,
  or `[B, H, T, K]` for layout "BHTK"), 'rows' (`[B, T, H]` / `[B, H, T]`: priors,
  lse), 'ids' (`[B, T]`: document ids), 'replicated' (traced scalars, small
  tables), or 'none' (a None argument, passed through).
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
  specs = {"qkv": P(b, h, None, None) if heads_first else P(b, None, h, None),
           "rows": P(b, h, None) if heads_first else P(b, None, h),
           "ids": P(b, None), "replicated": P(), "none": None}
  present = [i for i, kind in enumerate(kinds) if kind != "none"]

  def body(*given):
    full = [None] * len(arrays)
    for i, x in zip(present, given):
      full[i] = x
    return fn(*full)

  in_specs = tuple(specs[kinds[i]] for i in present)
  out_specs = tuple(specs[k] for k in out_kinds)
  mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                         out_specs=out_specs if len(out_specs) > 1 else out_specs[0],
                         axis_names=set(free), check_vma=False)
  return mapped(*[arrays[i] for i in present])
