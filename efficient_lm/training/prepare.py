"""The edge: checks a whole config before any data is prepared or anything compiles, and types it.

`prepare(config)` runs every check (each failure one `ConfigError` naming the field, the value
and the fix) and returns what runs below the edge takes instead of the ConfigDict: the typed
sections (`sections.Typed`) and the abstract train state on the job's mesh (`train_state.Built`:
the model built once, from shapes). `validate(config)` is its typed sections.
"""

import dataclasses

import jax
import ml_collections

from efficient_lm import data
from efficient_lm import models
from efficient_lm.config import base as config_base
from efficient_lm.config import sections
from efficient_lm.config.errors import require
from efficient_lm.parallel import sharding
from efficient_lm.parallel import targets
from efficient_lm.state import train_state


Typed = sections.Typed  # (re-exported: what `validate` returns)
typed = train_state.typed


def prepare(config: ml_collections.ConfigDict,
            devices=None) -> tuple[Typed, train_state.Built]:
  """The whole config against `devices` (default: the job's; a `--target`'s compile-only ones),
  its missing fields filled with their defaults first (`config_base.fill_defaults`; a given
  `data.tokenizer` sets `data.vocab_size`). Returns the typed sections and the abstract train
  state on the mesh of `devices` (`train_state.build(..., abstract=True)`)."""
  devices = list(jax.devices() if devices is None else devices)
  for section in ("data", "model", "train", "mesh"):
    require(section in config, f"config.{section}", None, "is missing",
            "start from a file in configs/, which defines every section")
  config_base.fill_defaults(config)
  # The four typed sections, each through its edge (`Section.from_mapping`: every declared check
  # and rule of the section alone), then the rules that involve the devices or other sections:
  # the mesh's, the data's (the registry, the disk), the model's on the platform and the ring.
  data_cfg, model, train, mesh_cfg = train_state.typed(config)
  sizes = sharding.validate(mesh_cfg, data_cfg, devices=devices,
                            grad_accum_steps=train.grad_accum_steps)
  rules = sharding.parse_rules(mesh_cfg, known=models.logical_axes())
  mesh = sharding.make_mesh(mesh_cfg, devices)
  data_cfg = data.validate(data_cfg, config.data)  # a given tokenizer sets data.vocab_size
  splits = data.known_splits(data_cfg)
  require(splits is None or train.eval_split in splits, "train.eval_split", train.eval_split,
          f"is not a split of {data_cfg.dataset}",
          f"set train.eval_split to one of {', '.join(splits or ())}")
  document_ids = data.has_document_ids(data_cfg)
  if model.vocab_size != data_cfg.vocab_size:  # (model.vocab_size follows data.vocab_size)
    model = dataclasses.replace(model, vocab_size=data_cfg.vocab_size)
  # The model built once, from shapes (`models.create` first checks it on the platform and the
  # ring: `models.placement`); the abstract train state is made from it.
  abstract = models.abstract_model(model, mesh, targets.platform_of(devices))
  typed_sections = Typed(data_cfg, model, train, mesh_cfg)
  built = train_state.build(typed_sections, mesh, abstract=True, model=abstract,
                            document_ids=document_ids)
  sharding.check_divisible(abstract.params, rules, sizes, models.logical_axes())
  sharding.check_replicated(abstract.params, rules, sizes, mesh_cfg.max_replicated_fraction)
  return typed_sections, built


def validate(config: ml_collections.ConfigDict, devices=None) -> Typed:
  """The typed sections of `prepare(config, devices)` (every check run)."""
  return prepare(config, devices)[0]
