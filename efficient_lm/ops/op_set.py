"""The one place that chooses a mixer's ops: single-device or context-parallel, and on which backend.

Every mixer calls its ops through an `OpSet` it was built with
(`models.create(..., mesh=)` makes it with `for_mesh`): the single-device ops
of `attention` / `memory` on the attention backend `impl` (`ops.core.backends`:
`model.attention_impl` resolved for the mesh's platform), or, when the mesh's
`context` axis has more than one device, the `ring` versions bound to that
mesh (their steps run on the XLA core). `attend` is `core.attend` on the same
backend, for the mixers' sequence chunks. A model never tests the mesh itself.
"""

import dataclasses
import functools
from typing import Callable

import jax

from efficient_lm.ops import attention
from efficient_lm.ops import core
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
  attend: Callable = core.attend
  layout: str = "natural"
  context: int = 1
  impl: str = "xla"
  interpret: bool = False


def single_device(impl: str = "xla", interpret: bool = False) -> OpSet:
  """The single-device ops on backend `impl` (resolved: not 'auto'); one object per backend."""
  return _single_device(impl, bool(interpret))


@functools.cache
def _single_device(impl: str, interpret: bool) -> OpSet:
  bind = lambda op: functools.partial(op, impl=impl, interpret=interpret)
  return OpSet(
      causal_attention=bind(attention.causal_attention),
      block_local_attention=bind(attention.block_local_attention),
      sliding_window_attention=bind(attention.sliding_window_attention),
      pi_attention=bind(attention.pi_attention),
      exponential_memory=memory.exponential_memory,
      shift_right=attention.shift_right,
      attend=bind(core.attend),
      impl=impl,
      interpret=interpret,
  )


SINGLE_DEVICE = single_device()


def context_size(mesh: jax.sharding.Mesh | None, axis_name: str = "context") -> int:
  """Devices along the sequence axis (1 without a mesh or without that axis)."""
  if mesh is None or axis_name not in mesh.axis_names:
    return 1
  return mesh.shape[axis_name]


def for_mesh(mesh: jax.sharding.Mesh | None, *, layout: str = "natural",
             axis_name: str = "context", impl: str = "xla", interpret: bool = False) -> OpSet:
  """The single-device ops on `impl` unless `mesh` has more than one device along `axis_name`:
  then the ring ops."""
  n = context_size(mesh, axis_name)
  if n == 1:
    return single_device(impl, interpret)
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
