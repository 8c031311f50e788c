"""The device mesh: a `data` axis (batch) and a `context` axis (sequence).

Parameters and optimizer state are replicated; a `[B, T]` batch is sharded
`P('data', 'context')`. With several processes every process's iterator yields the
same global batch and `shard_batch` places only the slices its own devices hold:
correct for any mesh layout (a context axis spanning hosts included), the iterator
state is the same on every process (one data checkpoint), and a run's batches do
not depend on the number of processes. Reading a global batch of token windows on
each host costs little next to a training step.
"""

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from efficient_lm.validation import require


def mesh_shape(mesh_cfg: ml_collections.ConfigDict, num_devices: int | None = None
               ) -> tuple[int, int]:
  """(data, context) sizes; `mesh.data=-1` takes every device the context axis leaves."""
  devices = jax.device_count() if num_devices is None else num_devices
  context = mesh_cfg.context
  require(isinstance(context, int) and context >= 1 and devices % context == 0, "mesh.context",
          context, f"must be a positive divisor of the {devices} available device(s)",
          "set mesh.context=1 or a divisor of the device count")
  data = devices // context if mesh_cfg.data == -1 else mesh_cfg.data
  # One process may use the first data * context devices when that divides the count (tests
  # run on 8 fake CPU devices with mesh.data=1); several processes use every device.
  used = data * context if isinstance(data, int) and data >= 1 else 0
  require(used == devices or (used and devices % used == 0 and jax.process_count() == 1),
          "mesh.data", mesh_cfg.data,
          f"times mesh.context={context} must equal the {devices} available device(s)",
          f"set mesh.data=-1 (all devices) or mesh.data={devices // context}")
  return data, context


def validate(mesh_cfg: ml_collections.ConfigDict, data_cfg: ml_collections.ConfigDict,
             num_devices: int | None = None) -> None:
  """The mesh against the device count, `data.batch_size` and `data.seq_len`; raises ConfigError."""
  data, context = mesh_shape(mesh_cfg, num_devices)
  require(data_cfg.seq_len % context == 0, "mesh.context", context,
          f"must divide data.seq_len={data_cfg.seq_len} (each device holds seq_len / context tokens)",
          f"set mesh.context to a divisor of {data_cfg.seq_len} or data.seq_len to a multiple of {context}")
  require(data_cfg.batch_size % data == 0, "data.batch_size", data_cfg.batch_size,
          f"must be divisible by the mesh's data axis ({data} devices)",
          f"set data.batch_size to a multiple of {data} or lower mesh.data")


def make_mesh(mesh_cfg: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  data, context = mesh_shape(mesh_cfg)
  return jax.make_mesh((data, context), ("data", "context"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:data * context])


def single_device_mesh() -> jax.sharding.Mesh:
  """A 1 x 1 mesh on the first device (what one-device code paths place arrays on)."""
  return jax.make_mesh((1, 1), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:1])


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """`[B, T]` arrays: B over `data`, T over `context`."""
  return NamedSharding(mesh, P("data", "context"))


def shard_batch(batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
  """The global host batch (the same on every process) as global arrays sharded `P('data', 'context')`.

  Each process copies only the slices its own devices hold; works for one process or many.
  """
  sharding = batch_sharding(mesh)
  return {name: jax.make_array_from_callback(x_BT.shape, sharding, lambda index, x_BT=x_BT: x_BT[index])
          for name, x_BT in batch.items()}
