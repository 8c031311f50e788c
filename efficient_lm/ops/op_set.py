"""The one place that chooses single-device or context-parallel (ring) ops for a mesh.

Every mixer calls its ops through an `OpSet` it was built with
(`models.create(..., mesh=)` makes it with `for_mesh`): the single-device ops
of `attention` / `memory`, or, when the mesh's `context` axis has more than one
device, the `ring` versions bound to that mesh. A model never tests the mesh
itself.
"""

import dataclasses
import functools
from typing import Callable

import jax

from efficient_lm.ops import attention
from efficient_lm.ops import memory
from efficient_lm.ops import ring


@dataclasses.dataclass(frozen=True)
class OpSet:
  """The ops a mixer may call, with the single-device signatures.

  `layout` is the sequence order the arrays arrive in ('natural', or 'zigzag'
  for load-balanced ring attention: the training loop permutes the batch once
  and passes the matching positions); `context` the devices along the sequence.
  """
  causal_attention: Callable
  block_local_attention: Callable
  sliding_window_attention: Callable
  pi_attention: Callable
  exponential_memory: Callable
  shift_right: Callable
  layout: str = "natural"
  context: int = 1


SINGLE_DEVICE = OpSet(
    causal_attention=attention.causal_attention,
    block_local_attention=attention.block_local_attention,
    sliding_window_attention=attention.sliding_window_attention,
    pi_attention=attention.pi_attention,
    exponential_memory=memory.exponential_memory,
    shift_right=attention.shift_right,
)


def context_size(mesh: jax.sharding.Mesh | None, axis_name: str = "context") -> int:
  """Devices along the sequence axis (1 without a mesh or without that axis)."""
  if mesh is None or axis_name not in mesh.axis_names:
    return 1
  return mesh.shape[axis_name]


def for_mesh(mesh: jax.sharding.Mesh | None, *, layout: str = "natural",
             axis_name: str = "context") -> OpSet:
  """`SINGLE_DEVICE` unless `mesh` has more than one device along `axis_name`: then the ring ops."""
  n = context_size(mesh, axis_name)
  if n == 1:
    return SINGLE_DEVICE
  if layout not in ring.LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {ring.LAYOUTS}")
  bind = lambda op: functools.partial(op, mesh=mesh, axis_name=axis_name)
  return OpSet(
      causal_attention=functools.partial(ring.causal_attention, mesh=mesh, axis_name=axis_name,
                                         layout=layout),
      block_local_attention=bind(ring.block_local_attention),
      sliding_window_attention=bind(ring.sliding_window_attention),
      pi_attention=bind(ring.pi_attention),
      exponential_memory=bind(ring.exponential_memory),
      shift_right=bind(ring.shift_right),
      layout=layout,
      context=n,
  )
