"""cuDNN for the `gpu` backend: `jax.nn.dot_product_attention(implementation="cudnn")` on each
device's shard, and the compute capability of the GPU being compiled for (`target_capability`),
which jax's cuDNN checks are made to answer for (below). `gpu.py` decides which calls come here
(`gpu._takes_cudnn`); k and v may have fewer heads than q (cuDNN's own grouped-query attention).
"""

import dataclasses
import functools
import re

import jax

from efficient_lm.runtime import jax_compat
from efficient_lm.ops.core import kernel_mesh
from efficient_lm.ops.core.call import Call

# cuDNN, and its compute-capability check answered for the compile target.
#
# jax's cuDNN wrapper asks `check_compute_capability` / `is_cuda_compute_capability_equal`
# (jax._src.cudnn.fused_attention_stablehlo) about the first *local* GPU, and says "no" on a
# host without one: compiling for a Hopper target from a CPU host would then refuse head
# widths over 128. While jax's forward rule traces a cuDNN call of ours,
# `jax_compat.cudnn_capability_answers` points those two functions at the target's capability
# (from the devices of the current mesh: `jax.set_mesh(Mesh(topology.devices, ...))`, or a
# local GPU), and restores them after.
# That forward rule may trace after our call returned (inside scan / checkpoint / an inner
# jit), so the call is our own custom VJP whose rules enter the patch themselves, with the
# capability found when the call was made. The patch is process-wide while it lasts: do not
# trace cuDNN calls for different targets in concurrent threads.

_KIND_CAPABILITY = {  # device_kind words -> compute capability (used when a device has no field)
    "V100": (7, 0), "T4": (7, 5), "A100": (8, 0), "A30": (8, 0), "A10": (8, 6), "A40": (8, 6),
    "L4": (8, 9), "L40": (8, 9), "L40S": (8, 9), "H100": (9, 0), "H200": (9, 0), "H20": (9, 0),
    "GH200": (9, 0), "B200": (10, 0), "GB200": (10, 0), "B300": (10, 3), "GB300": (10, 3),
}


def _parse_capability(text) -> tuple[int, int] | None:
  found = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", str(text))
  return (int(found.group(1)), int(found.group(2))) if found else None


def _mesh_device():
  """The first device of the concrete mesh of `jax.set_mesh` (seen while tracing only through
  jax's private API: `jax_compat.concrete_mesh`), or None."""
  mesh = jax_compat.concrete_mesh()
  return None if mesh is None else mesh.devices.flat[0]


def target_capability() -> tuple[int, int] | None:
  """The compute capability of the GPU being compiled for: the current mesh's device's
  (`compute_capability`, else known from its `device_kind`), else a local GPU's; None if unknown."""
  device = _mesh_device()
  abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is None and abstract is None:
    try:
      device = jax.devices("gpu")[0]
    except RuntimeError:
      return None
  if device is not None:
    if device.platform != "gpu":
      return None
    capability = _parse_capability(getattr(device, "compute_capability", ""))
    if capability is not None:
      return capability
    kind = device.device_kind
  elif abstract.platform == "gpu":
    kind = abstract.device_kind
  else:
    return None
  for name in sorted(_KIND_CAPABILITY, key=len, reverse=True):
    if re.search(rf"\b{name}\b", kind):
      return _KIND_CAPABILITY[name]
  return None


@dataclasses.dataclass(frozen=True)
class _Cudnn:
  scale: float
  window: int | None  # None: causal
  layout: str
  capability: tuple[int, int] | None


def _cudnn_call(spec: _Cudnn, q, k, v):
  bthk = (lambda x: x) if spec.layout == "BTHK" else (lambda x: jnp.swapaxes(x, 1, 2))
  window = None if spec.window is None else (spec.window - 1, 0)
  o_BTHK = jax.nn.dot_product_attention(bthk(q), bthk(k), bthk(v), scale=spec.scale,
                                        is_causal=True, local_window_size=window,
                                        implementation="cudnn")
  return bthk(o_BTHK)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cudnn(spec: _Cudnn, q, k, v):
  with jax_compat.cudnn_capability_answers(spec.capability):
    return _cudnn_call(spec, q, k, v)


def _cudnn_fwd(spec: _Cudnn, q, k, v):
  with jax_compat.cudnn_capability_answers(spec.capability):
    o, pullback = jax.vjp(functools.partial(_cudnn_call, spec), q, k, v)
  return o, pullback


def _cudnn_bwd(spec: _Cudnn, pullback, do):
  del spec
  return pullback(do)


_cudnn.defvjp(_cudnn_fwd, _cudnn_bwd)


def attend(call: Call, q, k, v):
  """o of a causal (or causal-window) self-attention call on cuDNN, per shard."""
  window = call.pattern.window
  spec = _Cudnn(scale=call.scale, window=window if window is not None and window < call.Tq else None,
                layout=call.layout, capability=target_capability())
  return kernel_mesh.per_shard(functools.partial(_cudnn, spec), [q, k, v], ["qkv", "kv", "kv"],
                               ["qkv"], layout=call.layout)
