"""The edge: checks a whole run before any data is prepared or anything compiles.

`prepare(run)` runs every check that needs more than the config (each failure one `ConfigError`
naming the field, the value and the fix): the mesh against the job's devices, the data against
the dataset's registry and the disk, the model on the platform and the ring, its parameters
against the mesh's rules. It returns the run as it will train (a given `data.tokenizer` fixes
the vocabulary: `RunConfig.with_vocab`) and the abstract train state on the job's mesh
(`train_state.Built`: the model built once, from shapes). The sections' own checks ran when the
`RunConfig` was built (`config.run.build`). `place(run, mesh)` is its last part: the model on a
mesh, again for a vocabulary the tokenizer fixes later (a small corpus).
"""

import jax

from efficient_lm import data
from efficient_lm import models
from efficient_lm.config.errors import require
from efficient_lm.config.run import RunConfig
from efficient_lm.parallel import sharding
from efficient_lm.parallel import targets
from efficient_lm.state import train_state


def prepare(run: RunConfig, devices=None) -> tuple[RunConfig, train_state.Built]:
  """`run` against `devices` (default: the job's; a `--target`'s compile-only ones). Returns the
  run as it trains (its vocabulary a given tokenizer's) and its abstract train state on the mesh
  of `devices` (`train_state.build(..., abstract=True)`)."""
  devices = list(jax.devices() if devices is None else devices)
  # The rules that involve the devices or other sections: the mesh's, the data's (the registry,
  # the disk), the model's on the platform and the ring, the parameters' on the mesh.
  sharding.validate(run.mesh, run.data, devices=devices,
                    grad_accum_steps=run.train.grad_accum_steps)
  sharding.parse_rules(run.mesh, known=models.logical_axes())
  mesh = sharding.make_mesh(run.mesh, devices)
  data_cfg = data.validate(run.data)  # a given tokenizer sets data.vocab_size
  splits = data.known_splits(data_cfg)
  require(splits is None or run.train.eval_split in splits, "train.eval_split",
          run.train.eval_split, f"is not a split of {data_cfg.dataset}",
          f"set train.eval_split to one of {', '.join(splits or ())}")
  run = run.with_vocab(data_cfg.vocab_size)
  return run, place(run, mesh)


def place(run: RunConfig, mesh: jax.sharding.Mesh) -> train_state.Built:
  """The abstract train state of `run` on `mesh`: the model built once, from shapes (`models.create`
  first checks it on the platform and the ring: `models.placement`), then its parameters against
  the mesh's rules (each sharded dimension divisible, not too much of them replicated)."""
  sizes = dict(mesh.shape)
  rules = sharding.parse_rules(run.mesh, known=models.logical_axes())
  abstract = models.abstract_model(run.model, mesh, targets.platform_of(list(mesh.devices.flat)))
  built = train_state.build(run, mesh, abstract=True, model=abstract,
                            document_ids=data.has_document_ids(run.data))
  sharding.check_divisible(abstract.params, rules, sizes, models.logical_axes())
  sharding.check_replicated(abstract.params, rules, sizes, run.mesh.max_replicated_fraction)
  return built


def validate(run: RunConfig, devices=None) -> RunConfig:
  """The run of `prepare(run, devices)` (every check run)."""
  return prepare(run, devices)[0]
