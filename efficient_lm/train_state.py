"""The one place that builds a train state: the model's parameters, the optimizer and its state.

    built = train_state.build(config, mesh)          # real arrays, placed on the mesh
    built = train_state.build(config, mesh, abstract=True)  # shapes only (restore, compile-only)

Used by the training loop, the sampler, the evaluation command and the
benchmarks, so that all of them train, restore and measure the same state. The
state is created by one jitted initializer whose outputs are placed directly on
the mesh (never a full host copy first).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from flax import struct

from efficient_lm import models
from efficient_lm import sections
from efficient_lm import optimizer
from efficient_lm import sharding


@struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class Built:
  """Everything a train or eval step needs besides the data."""
  graphdef: Any                 # the model's structure (nnx.graphdef): merge it with params
  state: TrainState             # arrays, or jax.ShapeDtypeStruct leaves when abstract
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  shardings: TrainState         # NamedSharding of every leaf of `state`
  mesh: jax.sharding.Mesh

  def describe(self) -> str:
    """Parameters and optimizer state per device: bytes and the replicated share."""
    params, params_replicated = sharding.per_device_bytes(self.state.params)
    opt, opt_replicated = sharding.per_device_bytes(self.state.opt_state)
    mib = lambda b: f"{b / 2**20:,.1f} MiB"
    return (f"per device: parameters {mib(params)} ({params_replicated:.0%} replicated), optimizer "
            f"state {mib(opt)} ({opt_replicated:.0%} replicated) on a "
            f"{' x '.join(f'{a}={n}' for a, n in self.mesh.shape.items())} mesh")

  @property
  def num_params(self) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(self.state.params))


def build(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh | None = None, *,
          abstract: bool = False, seed: int | None = None) -> Built:
  """The train state of `config` (parameters from `train.seed`, or `seed`), sharded on `mesh`.

  Every parameter is placed by its logical axis names and `mesh.rules`
  (`sharding.tree_shardings`); the optimizer state like its parameter (also
  over `data` with `mesh.shard_optimizer_over_data`); the step replicated.
  With a mesh whose `context` axis has several devices the model calls the
  ring ops. `abstract=True` gives shapes, dtypes and shardings only (nothing is
  computed): what a checkpoint restores onto, or what `--compile_only` compiles.
  """
  config = config if isinstance(config, sections.Typed) else sections.typed(config)  # once
  seed = config.train.seed if seed is None else seed
  mesh = sharding.single_device_mesh() if mesh is None else mesh
  rules = config.mesh.rule_axes
  tx, schedule = optimizer.make_optimizer(config.train)
  make_model = lambda: models.create(config.model, rngs=nnx.Rngs(seed), mesh=mesh)

  graphdefs = []  # the model's structure, kept from the trace of `init` (no second build for it)

  def init() -> TrainState:
    model = make_model()
    graphdefs.append(nnx.graphdef(model))
    params = nnx.state(model)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  shapes = jax.eval_shape(init)
  graphdef = graphdefs[0]
  zero1 = "data" if config.mesh.shard_optimizer_over_data else None
  shardings = TrainState(
      step=sharding.replicated(mesh),
      params=sharding.tree_shardings(shapes.params, mesh, rules),
      opt_state=sharding.tree_shardings(shapes.opt_state, mesh, rules, extra_axis=zero1))
  if abstract:
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         shapes, shardings)
  else:
    state = jax.jit(init, out_shardings=shardings)()
  return Built(graphdef=graphdef, state=state, tx=tx, schedule=schedule, shardings=shardings,
               mesh=mesh)
