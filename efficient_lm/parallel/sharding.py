"""The device mesh, logical axis rules, and where every array of a run lives.

The mesh has four axes, sized by `mesh.data`, `mesh.fsdp`, `mesh.tensor` and
`mesh.context` (exactly one may be -1: it takes the devices the others leave;
by default `mesh.fsdp=-1`, so a plain multi-device run shards its parameters):

- `data`: plain data parallelism: the batch is split, parameters replicated.
- `fsdp`: the batch is split and so are the parameters and optimizer state
  (each device keeps 1/fsdp; XLA gathers a layer's weights when it runs and
  reduce-scatters their gradients).
- `tensor`: tensor parallelism: heads, MLP width and vocabulary split.
- `context`: the sequence split (context parallelism, `ops.ring`).

Parameters carry logical axis names in their Flax metadata (`out_sharding`): the
decoder's (`SHARED_AXES`: `embed`, `mlp`, `heads`, `kv`, `vocab`, `layers`, ...) and each
family's own, declared by its registry entry; `mesh.rules` maps each name to a mesh axis ('' =
replicated). A `[B, T]` batch is sharded `P(('data', 'fsdp'), 'context')`. With several processes every
process's iterator yields the same global batch and `shard_batch` places only
the slices its own devices hold.
"""

import contextlib
import functools
import math
from typing import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from efficient_lm.config.axes import Axis, SHARED_AXES, default_activation_rules, default_rules  # noqa: F401  (re-exported)
from efficient_lm.config.data import DataConfig
from efficient_lm.config.errors import ConfigError, require
from efficient_lm.config.mesh import ACTIVATION_AXES, AXES, DCN_AXES, MeshConfig, MeshOnDevices

BATCH_AXES = ("data", "fsdp")  # the axes the batch is split over


def mesh_sizes(mesh_cfg: MeshConfig, num_devices: int | None = None) -> dict[str, int]:
  """{axis: size} for the four axes; the one at -1 takes every device the others leave.

  One process may use the first devices of a divisor of its device count (the
  tests run 1-device meshes on 8 fake CPU devices); several processes use all.
  """
  devices = jax.device_count() if num_devices is None else num_devices
  sizes = mesh_cfg.sizes()  # at most one -1 (`MeshConfig.RULES`)
  free = [axis for axis, size in sizes.items() if size == -1]
  fixed = math.prod(size for size in sizes.values() if size != -1)
  others = lambda axis: " x ".join(f"{a}={sizes[a]}" for a in AXES if a != axis)
  culprit = next((a for a in AXES if sizes[a] > 1 and devices % sizes[a]), None) or next(
      (a for a in reversed(AXES) if sizes[a] > 1), "data")
  if free:
    require(devices % fixed == 0, f"mesh.{culprit}", sizes[culprit],
            f"must be a positive divisor of the {devices} available device(s), together with the "
            f"other axes ({others(culprit)})",
            f"set mesh.{culprit} so that data x fsdp x tensor x context divides {devices}")
    sizes[free[0]] = devices // fixed
  used = math.prod(sizes.values())
  rest = used // sizes[culprit]
  hint = (f"mesh.{culprit}={devices // rest}" if devices % rest == 0
          else f"mesh.{culprit} to a divisor of {devices}")
  require(used == devices or (devices % used == 0 and jax.process_count() == 1),
          f"mesh.{culprit}", sizes[culprit],
          f"times the other axes ({others(culprit)}) must equal the {devices} available device(s)",
          f"set {hint}, or one axis to -1 (all the devices the others leave)")
  return sizes


def _product(sizes: dict) -> str:
  return " x ".join(f"{a}={s}" for a, s in sizes.items())


def parse_rules(mesh_cfg: MeshConfig,
                known: Mapping[str, Axis] | None = None) -> dict[str, tuple[str, ...]]:
  """`mesh.rules` as {logical name: mesh axes}; '' (or 'none') is replicated, 'data,fsdp' two axes.
  A name the rules lack is replicated. With `known` (every axis a model declares:
  `models.logical_axes()`) a name outside it is a ConfigError."""
  if known is not None:
    unknown = sorted(set(mesh_cfg.rules.keys()) - set(known))
    require(not unknown, f"mesh.rules.{unknown[0] if unknown else ''}",
            mesh_cfg.rules[unknown[0]] if unknown else None,
            "is not a logical axis of any model's parameters", f"use one of {', '.join(known)}")
  return mesh_cfg.rule_axes


def logical_spec(names: tuple | None, rules: dict[str, tuple[str, ...]]) -> P:
  """A parameter's logical names -> its PartitionSpec. A mesh axis is used once per array (a later
  dimension mapped to an axis already used stays replicated)."""
  if not names:
    return P()
  used, spec = set(), []
  for name in names:
    axes = tuple(a for a in rules.get(name, ()) if a not in used) if name else ()
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*spec)


def is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def variable_names(x) -> tuple | None:
  """The logical axis names a Variable carries (its `out_sharding` metadata), or None."""
  return x.get_metadata().get("out_sharding") if is_variable(x) else None


def _fits(shape, spec: P, sizes: dict[str, int]) -> P:
  """The spec without mesh axes of size 1, and any dimension its axes do not divide replicated."""
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    names = tuple(a for a in names if sizes[a] > 1)
    if not names or dim % math.prod(sizes[a] for a in names):
      out.append(None)
    else:
      out.append(names[0] if len(names) == 1 else names)
  return P(*out)


def tree_shardings(tree, mesh: jax.sharding.Mesh, rules: dict, *, extra_axis: str | None = None):
  """NamedShardings for every leaf of `tree` (an abstract train state): Variables by their logical
  names; other leaves (step counters) replicated. `extra_axis` (ZeRO-1: 'data') also splits the
  largest dimension it divides."""
  sizes = dict(mesh.shape)

  def one(x):
    value = x.get_value() if is_variable(x) else x
    shape = getattr(value, "shape", ())
    spec = logical_spec(variable_names(x), rules)
    spec = _fits(shape, spec, sizes)
    if extra_axis and sizes.get(extra_axis, 1) > 1 and extra_axis not in _axes_of(spec):
      spec = _add_axis(shape, spec, extra_axis, sizes)
    sharding = NamedSharding(mesh, spec)
    return x.replace(sharding) if is_variable(x) else sharding

  return jax.tree.map(one, tree, is_leaf=is_variable)


def _axes_of(spec: P) -> set[str]:
  out = set()
  for axes in spec:
    if axes is not None:
      out.update((axes,) if isinstance(axes, str) else axes)
  return out


def _add_axis(shape, spec: P, axis: str, sizes: dict[str, int]) -> P:
  entries = list(tuple(spec) + (None,) * (len(shape) - len(spec)))
  for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
    current = () if entries[dim] is None else (
        (entries[dim],) if isinstance(entries[dim], str) else tuple(entries[dim]))
    if shape[dim] % (math.prod(sizes[a] for a in current) * sizes[axis]) == 0:
      entries[dim] = current + (axis,) if current else axis
      return P(*entries)
  return spec


# `mesh.activation_rules` maps the logical axes an activation may carry (`ACTIVATION_AXES`:
# `constrain`) to mesh axes; `batch` and `length` are where the input batch is placed
# (`batch_sharding`): the batch axes and `context`, not configurable.


def parse_activation_rules(mesh_cfg: MeshConfig) -> dict[str, tuple[str, ...]]:
  """`mesh.activation_rules` as {activation axis: mesh axes}, `batch` and `length` included."""
  return mesh_cfg.activation_axes


@functools.cache
def _default_activation_rules() -> dict[str, tuple[str, ...]]:
  return parse_activation_rules(MeshConfig())


_activation_rules: list[dict] = []  # the rules of the step being traced (`OnMesh`), innermost last


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
  """Pins an activation to its logical axes (`names`, one per leading dimension, None = whole)
  by the rules of the step being traced (`OnMesh`: `mesh.activation_rules`; else the defaults),
  when traced under `jax.set_mesh`; else unchanged. Mesh axes of size 1 or that do not divide a
  dimension are dropped; an axis is used once per array.

  Without it XLA's propagation may pick a layout it cannot leave efficiently and replicate a whole
  activation (an "involuntary full rematerialization") instead of gathering a layer's weights."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  rules = _activation_rules[-1] if _activation_rules else _default_activation_rules()
  sizes = {a: mesh.shape.get(a, 1) for a in AXES}
  spec = _fits(x.shape, logical_spec(tuple(names), rules), sizes)
  if all(axes is None for axes in spec):
    return x
  return jax.lax.with_sharding_constraint(x, spec)


class OnMesh:
  """A jitted function traced (called or lowered) under `jax.set_mesh(mesh)` and the activation
  rules (`parse_activation_rules`; None = the defaults), so that the model's activation
  constraints (`constrain`) see both."""

  def __init__(self, jitted, mesh: jax.sharding.Mesh, activation_rules: dict | None = None):
    self.jitted, self.mesh = jitted, mesh
    self.rules = activation_rules or _default_activation_rules()

  @contextlib.contextmanager
  def _tracing(self):
    _activation_rules.append(self.rules)
    try:
      with jax.set_mesh(self.mesh):
        yield
    finally:
      _activation_rules.pop()

  def __call__(self, *args):
    with self._tracing():
      return self.jitted(*args)

  def lower(self, *args):
    with self._tracing():
      return self.jitted.lower(*args)


def num_slices(devices) -> int:
  """How many slices (TPU slices joined by the data-center network) the devices span."""
  return len({getattr(d, "slice_index", 0) or 0 for d in devices})


def dcn_sizes(mesh_cfg: MeshConfig, slices: int) -> dict[str, int]:
  """{axis: slices along it} for the axes across slices; one of them may be -1 (the slices the
  other leaves; `mesh.dcn_data=-1` by default: plain data parallelism across slices)."""
  sizes = {axis: getattr(mesh_cfg, f"dcn_{axis}") for axis in DCN_AXES}  # one -1 at most
  free = [axis for axis, size in sizes.items() if size == -1]
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if free:
    require(slices % fixed == 0, f"mesh.dcn_{'fsdp' if free[0] == 'data' else 'data'}", fixed,
            f"must divide the {slices} slice(s)", "set it to a divisor of the number of slices")
    sizes[free[0]] = slices // fixed
  require(math.prod(sizes.values()) == slices, "mesh.dcn_data", sizes["data"],
          f"times mesh.dcn_fsdp={sizes['fsdp']} must equal the {slices} slice(s) the devices span",
          f"set mesh.dcn_data={slices} and mesh.dcn_fsdp=1 (or -1 on one of them)")
  return sizes


def make_mesh(mesh_cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
  """The four-axis mesh over `devices` (default: every device of the job; a `--target`'s
  compile-only devices). Over several slices it is a hybrid mesh: each axis is `mesh.<axis>`
  devices inside a slice (ICI) times `mesh.dcn_<axis>` slices (the data-center network)."""
  devices = list(jax.devices() if devices is None else devices)
  slices = num_slices(devices)
  dcn = dcn_sizes(mesh_cfg, slices)
  sizes = mesh_sizes(mesh_cfg, len(devices) // slices)
  auto = (jax.sharding.AxisType.Auto,) * len(AXES)
  if slices == 1:
    return jax.make_mesh(tuple(sizes.values()), AXES, axis_types=auto,
                         devices=devices[:math.prod(sizes.values())])
  from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
  grid = mesh_utils.create_hybrid_device_mesh(
      tuple(sizes[a] for a in AXES), tuple(dcn.get(a, 1) for a in AXES), devices,
      allow_split_physical_axes=True)
  return jax.sharding.Mesh(grid, AXES, axis_types=auto)


def mesh_shape(mesh_cfg: MeshConfig, devices) -> dict[str, int]:
  """{axis: devices along it} of `make_mesh(mesh_cfg, devices)` (ICI x DCN), without building it."""
  devices = list(devices)
  slices = num_slices(devices)
  dcn = dcn_sizes(mesh_cfg, slices)
  sizes = mesh_sizes(mesh_cfg, len(devices) // slices)
  return {axis: sizes[axis] * dcn.get(axis, 1) for axis in AXES}


def single_device_mesh() -> jax.sharding.Mesh:
  """A mesh of one device with the four axes (what one-device code paths place arrays on)."""
  return jax.make_mesh((1, 1, 1, 1), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4,
                       devices=jax.devices()[:1])


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...] | None:
  """The mesh axes a batch dimension is split over (those of `BATCH_AXES` the mesh has)."""
  axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
  return axes or None


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """`[B, T]` arrays: B over (`data`, `fsdp`), T over `context`."""
  return NamedSharding(mesh, P(batch_axes(mesh), "context" if "context" in mesh.axis_names else None))


def shard_batch(batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh,
                rows: tuple[int, int, int] | None = None) -> dict[str, jax.Array]:
  """A host batch as global arrays, B over (data, fsdp) and T over context; each process copies
  only the slices its own devices hold. `batch` is the whole global batch, or with `rows` =
  (first, last, global batch size) only this process's rows first..last-1 of it (`process_rows`)."""
  sharding = batch_sharding(mesh)
  first, global_rows = (0, None) if rows is None else (rows[0], rows[2])

  def place(x_BT):
    shape = x_BT.shape if global_rows is None else (global_rows, *x_BT.shape[1:])
    local = lambda index: x_BT[(slice(index[0].start - first if index[0].start is not None else 0,
                                      index[0].stop - first if index[0].stop is not None else None),
                                *index[1:])]
    return jax.make_array_from_callback(shape, sharding, local if rows is not None else
                                        (lambda index: x_BT[index]))

  return {name: place(x_BT) for name, x_BT in batch.items()}


def process_rows(mesh: jax.sharding.Mesh, batch_size: int, seq_len: int) -> tuple[int, int] | None:
  """The rows [first, last) of a `[batch_size, seq_len]` batch this process's devices hold, when
  they are this process's equal, contiguous share in process order (then each process reads only
  those: per-host input); None when several processes share rows (context across hosts)."""
  if jax.process_count() == 1:
    return None
  index_map = batch_sharding(mesh).addressable_devices_indices_map((batch_size, seq_len))
  starts = [idx[0].start or 0 for idx in index_map.values()]
  stops = [batch_size if idx[0].stop is None else idx[0].stop for idx in index_map.values()]
  first, last = min(starts), max(stops)
  share = batch_size // jax.process_count()
  if (last - first) != share or first != jax.process_index() * share:
    return None
  return first, last


def per_device_bytes(tree) -> tuple[int, float]:
  """(bytes one device holds of `tree`'s arrays or abstract arrays with shardings, the fraction of
  them that are replicated on every device)."""
  total = replicated_bytes = 0
  for x in jax.tree.leaves(tree):
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    total += nbytes
    if sharding is None or sharding.is_fully_replicated:
      replicated_bytes += nbytes
  return total, (replicated_bytes / total if total else 0.0)


def check_divisible(abstract_params, rules: Mapping[str, tuple[str, ...]], sizes: dict[str, int],
                    logical_axes: Mapping[str, Axis] = SHARED_AXES) -> None:
  """Every parameter dimension a rule (`parse_rules`) shards must be divisible by its mesh axes;
  raises ConfigError naming the config field that sets the dimension (`logical_axes`:
  `models.logical_axes()`)."""
  for x in jax.tree.leaves(abstract_params, is_leaf=is_variable):
    names = variable_names(x)
    if not names:
      continue
    shape = x.get_value().shape
    for dim, name in zip(shape, names):
      axes = rules.get(name, ()) if name else ()
      size = math.prod(sizes[a] for a in axes)
      field = logical_axes[name].size if name in logical_axes else name
      require(dim % size == 0, field, dim,
              f"is not divisible by {' x '.join(f'mesh.{a}={sizes[a]}' for a in axes)} "
              f"(mesh.rules.{name}={','.join(axes)!r} shards it)",
              f"make it a multiple of {size}, or set mesh.rules.{name}='' to keep it replicated")


# Below this many replicated parameters per device (4 MiB in float32) replication cannot matter
# for fit: a tiny model's norms and biases are a large share of it, and that is fine.
REPLICATED_FLOOR = 1 << 20


def check_replicated(abstract_params, rules: Mapping[str, tuple[str, ...]], sizes: dict[str, int],
                     limit: float) -> float:
  """The share of the parameters (and so of the optimizer state) every device holds whole; a
  ConfigError above `limit` (`mesh.max_replicated_fraction`, 0.05) on a mesh that shards
  parameters (fsdp or tensor > 1), once over `REPLICATED_FLOOR` parameters, naming the largest
  replicated parameters and a rule (of `rules`: `parse_rules`) that would shard them."""
  if sizes.get("fsdp", 1) * sizes.get("tensor", 1) == 1:
    return 0.0
  total = replicated = 0.0
  offenders = []
  for path, x in jax.tree_util.tree_leaves_with_path(abstract_params, is_leaf=is_variable):
    if not is_variable(x):
      continue
    shape = x.get_value().shape
    size = float(np.prod(shape, dtype=np.float64))
    spec = _fits(shape, logical_spec(variable_names(x), rules), sizes)
    split = math.prod(sizes[a] for a in _axes_of(spec))
    total += size / split
    if split == 1:
      replicated += size
      offenders.append((size, jax.tree_util.keystr(path), variable_names(x), shape))
  fraction = replicated / total if total else 0.0
  if fraction > limit and replicated > REPLICATED_FLOOR:
    offenders.sort(reverse=True)
    _, path, names, shape = offenders[0]
    axis = "fsdp" if sizes.get("fsdp", 1) > 1 else "tensor"
    fix = next((f"mesh.rules.{n}={axis!r}" for n, d in zip(names or (), shape)
                if n and n != "layers" and d % sizes[axis] == 0), "a rule for its axes")
    others = ", ".join(p for _, p, _, _ in offenders[1:3])
    raise ConfigError(
        f"mesh.max_replicated_fraction={limit}: {fraction:.0%} of the parameters per device are "
        f"replicated on this {_product(sizes)} mesh, the largest {path} {list(shape)} (logical "
        f"axes {names}){', then ' + others if others else ''}; set {fix} to shard it, or raise "
        "mesh.max_replicated_fraction")
  return fraction


def validate(mesh_cfg: MeshConfig, data_cfg: DataConfig,
             num_devices: int | None = None, grad_accum_steps: int = 1, *,
             devices=None) -> dict[str, int]:
  """The mesh against the devices (`devices`, or `num_devices` of one slice, default the job's),
  `data.batch_size` and `data.seq_len`; raises ConfigError. Returns the size of every axis."""
  if num_devices is not None:
    sizes = mesh_sizes(mesh_cfg, num_devices)
  else:
    sizes = mesh_shape(mesh_cfg, jax.devices() if devices is None else devices)
  MeshOnDevices(sizes=sizes, seq_len=data_cfg.seq_len, batch_size=data_cfg.batch_size,
                grad_accum_steps=grad_accum_steps)  # its rules: the batch and sequence split
  return sizes


__all__ = ["AXES", "BATCH_AXES", "ConfigError", "batch_sharding", "make_mesh", "mesh_sizes",
           "per_device_bytes", "replicated", "shard_batch", "tree_shardings", "validate"]
