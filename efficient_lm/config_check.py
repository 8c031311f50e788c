"""Checks a whole config before any data is prepared or anything compiles.

Each failure is one `ConfigError` naming the field, the value and the fix.
"""

import jax
import ml_collections

from efficient_lm import config_base
from efficient_lm import data
from efficient_lm import models
from efficient_lm import sections
from efficient_lm import sharding
from efficient_lm import targets
from efficient_lm import train_config
from efficient_lm.validation import require


Typed = sections.Typed  # (re-exported: what `validate` returns)
typed = sections.typed


def validate(config: ml_collections.ConfigDict, devices=None) -> Typed:
  """The whole config against `devices` (default: the job's; a `--target`'s compile-only ones),
  its missing fields filled with their defaults first (`config_base.fill_defaults`). Returns the
  typed sections (what runs below the edge takes them, not the ConfigDict)."""
  devices = list(jax.devices() if devices is None else devices)
  for section in ("data", "model", "train", "mesh"):
    require(section in config, f"config.{section}", None, "is missing",
            "start from a file in configs/, which defines every section")
  config_base.fill_defaults(config)
  # The four typed sections, each built through its edge (`Section.from_mapping`: every declared
  # check of the section alone), then the rules that involve the devices or other sections.
  data_cfg = data.validate(config.data)  # `DataConfig`, then the registry's and the disk's checks
  platform = targets.platform_of(devices)
  model = models.validate(config.model, platform)  # `ModelConfig`, then the backend's checks
  train = train_config.TrainConfig.from_mapping(config.train)
  mesh = sharding.mesh_config(config.mesh)
  splits = data.known_splits(config.data)
  require(splits is None or train.eval_split in splits, "train.eval_split", train.eval_split,
          f"is not a split of {data_cfg.dataset}",
          f"set train.eval_split to one of {', '.join(splits or ())}")
  sharding.parse_rules(mesh, known=models.logical_axes())
  sizes = sharding.validate(mesh, data_cfg, devices=devices,
                            grad_accum_steps=train.grad_accum_steps)
  models.validate_context(model, sizes["context"])  # ring ops: support, block alignment
  params = models.abstract_params(model, platform)
  sharding.check_divisible(params, mesh, sizes, models.logical_axes())
  sharding.check_replicated(params, mesh, sizes)
  return Typed(data_cfg, model, train, mesh)
