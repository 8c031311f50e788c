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

  @property
  def num_params(self) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(self.state.params))


def build(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh | None = None, *,
          abstract: bool = False, seed: int | None = None) -> Built:
  """The train state of `config` (parameters from `train.seed`, or `seed`), placed on `mesh`.

  With a mesh whose `context` axis has several devices the model calls the
  ring ops. `abstract=True` gives shapes, dtypes and shardings only (nothing is
  computed): what a checkpoint restores onto, or what `--compile_only` compiles.
  """
  seed = config.train.seed if seed is None else seed
  tx, schedule = optimizer.make_optimizer(config.train)

  def init() -> TrainState:
    model = models.create(config.model, rngs=nnx.Rngs(seed), mesh=mesh)
    params = nnx.state(model)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  graphdef = nnx.graphdef(nnx.eval_shape(
      lambda: models.create(config.model, rngs=nnx.Rngs(seed), mesh=mesh)))
  shapes = jax.eval_shape(init)
  if mesh is None:
    mesh = sharding.single_device_mesh()
  shardings = jax.tree.map(lambda _: sharding.replicated(mesh), shapes)
  if abstract:
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         shapes, shardings)
  else:
    state = jax.jit(init, out_shardings=shardings)()
  return Built(graphdef=graphdef, state=state, tx=tx, schedule=schedule, shardings=shardings)
