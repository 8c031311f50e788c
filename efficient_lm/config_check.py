"""Checks a whole config before any data is prepared or anything compiles.

Each failure is one `ConfigError` naming the field, the value and the fix.
"""

import jax
import ml_collections

from efficient_lm import config_base
from efficient_lm import data
from efficient_lm import models
from efficient_lm import sharding
from efficient_lm import targets
from efficient_lm import train_config
from efficient_lm.validation import require


def validate(config: ml_collections.ConfigDict, devices=None) -> None:
  """The whole config against `devices` (default: the job's; a `--target`'s compile-only ones),
  its missing fields filled with their defaults first (`config_base.fill_defaults`)."""
  devices = list(jax.devices() if devices is None else devices)
  for section in ("data", "model", "train", "mesh"):
    require(section in config, f"config.{section}", None, "is missing",
            "start from a file in configs/, which defines every section")
  config_base.fill_defaults(config)
  data.validate(config.data)
  platform = targets.platform_of(devices)
  models.validate(config.model, platform)
  train_config.TrainConfig.from_mapping(config.train)
  splits = data.known_splits(config.data)
  require(splits is None or config.train.eval_split in splits, "train.eval_split",
          config.train.eval_split, f"is not a split of {config.data.dataset}",
          f"set train.eval_split to one of {', '.join(splits or ())}")
  sharding.parse_rules(config.mesh, known=models.logical_axes())
  sizes = sharding.validate(config.mesh, config.data, devices=devices,
                            grad_accum_steps=config.train.grad_accum_steps)
  models.validate_context(config.model, sizes["context"])  # ring ops: support, block alignment
  params = models.abstract_params(config.model, platform)
  sharding.check_divisible(params, config.mesh, sizes, models.logical_axes())
  sharding.check_replicated(params, config.mesh, sizes)
