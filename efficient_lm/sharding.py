"""The device mesh: a `data` axis (batch) and a `context` axis (sequence).

Parameters and optimizer state are replicated; batches are sharded over `data`
(and, once the context-parallel ops exist, their sequence axis over `context`).
"""

import jax
import ml_collections
from jax.sharding import NamedSharding, PartitionSpec as P

from efficient_lm.validation import require


def mesh_shape(mesh_cfg: ml_collections.ConfigDict) -> tuple[int, int]:
  """(data, context) sizes; `mesh.data=-1` takes every device the context axis leaves."""
  devices = jax.device_count()
  context = mesh_cfg.context
  require(isinstance(context, int) and context >= 1 and devices % context == 0, "mesh.context",
          context, f"must be a positive divisor of the {devices} available device(s)",
          "set mesh.context=1 or a divisor of the device count")
  data = devices // context if mesh_cfg.data == -1 else mesh_cfg.data
  require(isinstance(data, int) and data >= 1 and data * context == devices, "mesh.data",
          mesh_cfg.data, f"times mesh.context={context} must equal the {devices} available device(s)",
          f"set mesh.data=-1 (all devices) or mesh.data={devices // context}")
  return data, context


def make_mesh(mesh_cfg: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  return jax.make_mesh(mesh_shape(mesh_cfg), ("data", "context"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """`[B, T]` arrays: B over `data`."""
  return NamedSharding(mesh, P("data"))


def shard_batch(batch: dict, mesh: jax.sharding.Mesh) -> dict:
  """Places a host batch of numpy arrays on the mesh (single-process)."""
  return jax.device_put(batch, batch_sharding(mesh))
