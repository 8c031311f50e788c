"""Mixed precision for the ops and models: matmuls in the compute dtype, accumulated in float32.

`einsum_f32(spec, a, b)` multiplies in the inputs' dtype (bfloat16 on
accelerators) and returns float32 sums, never rounded to the compute dtype.
On GPU and TPU that is `preferred_element_type=float32`. XLA's CPU runtime
cannot run every bfloat16 x bfloat16 -> float32 dot ("Unsupported element
type for DotThunk"), so on CPU the operands are upcast first: bfloat16 values
are exact in float32, so the products and float32 sums are the same numbers.
The platform is the one being compiled for (`platform()`: the devices of the
mesh traced under, so a TPU target compiled from a CPU host gets the TPU's
program), not the host's.
"""

import jax
import jax.numpy as jnp

from efficient_lm.runtime import jax_compat


def platform() -> str:
  """'cpu', 'gpu' or 'tpu': the devices of the mesh being traced under (`jax.set_mesh`), else
  jax's default backend."""
  mesh = jax_compat.concrete_mesh()  # jax has no public way to read it while tracing
  name = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
  return "gpu" if name in ("cuda", "rocm") else name


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """`jnp.einsum(spec, a, b)` with float32 accumulation and a float32 result."""
  if platform() == "cpu" and (a.dtype != jnp.float32 or b.dtype != jnp.float32):
    return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
