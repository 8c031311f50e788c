"""The one place that builds a train state: the model's parameters, the optimizer and its state.

    built = train_state.build(run, mesh)                 # real arrays, placed on the mesh
    built = train_state.build(run, mesh, abstract=True)  # shapes only (restore, compile-only)

Used by the training loop, the sampler, the evaluation command and the
benchmarks, so that all of them train, restore and measure the same state. The
state is created by one jitted initializer whose outputs are placed directly on
the mesh (never a full host copy first).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax import struct

from efficient_lm import models
from efficient_lm.config.run import RunConfig
from efficient_lm.data import config as data_config
from efficient_lm.parallel import sharding
from efficient_lm.state import optimizer


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
  layout: str = "natural"       # the order the step takes a batch's tokens in (`ops.ring`)
  document_ids: bool = False    # whether its batches carry `segment_ids` (`data.has_document_ids`)

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


def build(run: RunConfig, mesh: jax.sharding.Mesh | None = None, *,
          abstract: bool = False, seed: int | None = None,
          model: models.AbstractModel | None = None, document_ids: bool | None = None) -> Built:
  """The train state of `run` (parameters from `train.seed`, or `seed`), sharded on `mesh`.

  Every parameter is placed by its logical axis names and `mesh.rules`
  (`sharding.tree_shardings`); the optimizer state like its parameter (also
  over `data` with `mesh.shard_optimizer_over_data`); the step replicated.
  With a mesh whose `context` axis has several devices the model calls the
  ring ops. `abstract=True` gives shapes, dtypes and shardings only (nothing is
  computed): what a checkpoint restores onto, or what `--compile_only` compiles.
  `model`: `models.abstract_model(run.model, mesh)` where the caller has it (the edge): the
  structure and the shapes are taken from it, and an abstract state builds no model at all.
  `document_ids`: `data.has_document_ids(run.data)`, where the caller knows it.
  """
  seed = run.train.seed if seed is None else seed
  mesh = sharding.single_device_mesh() if mesh is None else mesh
  rules = run.mesh.rule_axes
  tx, schedule = optimizer.make_optimizer(run.train)
  if model is None:
    model = models.abstract_model(run.model, mesh)
  shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=model.params,
                      opt_state=jax.eval_shape(tx.init, model.params))
  zero1 = "data" if run.mesh.shard_optimizer_over_data else None
  shardings = TrainState(
      step=sharding.replicated(mesh),
      params=sharding.tree_shardings(shapes.params, mesh, rules),
      opt_state=sharding.tree_shardings(shapes.opt_state, mesh, rules, extra_axis=zero1))
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       shapes, shardings)
  if document_ids is None:
    document_ids = data_config.has_document_ids(run.data)
  built = Built(graphdef=model.graphdef, state=state, tx=tx, schedule=schedule,
                shardings=shardings, mesh=mesh, layout=model.layout, document_ids=document_ids)
  return built if abstract else dataclasses.replace(built, state=initialize(run, built, seed))


def initialize(run: RunConfig, built: Built, seed: int | None = None) -> TrainState:
  """The real train state of an abstract `built` (`build(..., abstract=True)`): the model's
  parameters from `train.seed` (or `seed`) and the optimizer's state, made by one jitted
  initializer whose outputs land in `built.shardings` (never a full host copy first)."""
  seed = run.train.seed if seed is None else seed

  def init() -> TrainState:
    params = nnx.state(models.create(run.model, rngs=nnx.Rngs(seed), mesh=built.mesh))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=built.tx.init(params))

  return jax.jit(init, out_shardings=built.shardings)()
