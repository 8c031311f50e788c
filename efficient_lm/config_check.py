"""Checks a whole config before any data is prepared or anything compiles.

Each failure is one `ConfigError` naming the field, the value and the fix.
"""

import jax
import ml_collections

from efficient_lm import config_base
from efficient_lm import data
from efficient_lm import models
from efficient_lm import optimizer
from efficient_lm import sharding
from efficient_lm import targets
from efficient_lm.validation import require, require_positive_int


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
  _validate_train(config.train)
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


def _validate_train(t: ml_collections.ConfigDict) -> None:
  require_positive_int("train.num_steps", t.num_steps)
  require(isinstance(t.learning_rate, (int, float)) and t.learning_rate > 0, "train.learning_rate",
          t.learning_rate, "must be positive", "set train.learning_rate to e.g. 1e-3")
  require(isinstance(t.warmup_steps, int) and 0 <= t.warmup_steps, "train.warmup_steps",
          t.warmup_steps, "must be a non-negative integer", "set train.warmup_steps to e.g. 100")
  require(t.schedule in optimizer.SCHEDULES, "train.schedule", t.schedule,
          "is not a known schedule", f"use one of {', '.join(optimizer.SCHEDULES)}")
  fraction = t.decay_fraction
  require(isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0, "train.decay_fraction",
          fraction, "must be in (0, 1]", "set train.decay_fraction to e.g. 0.2")
  require(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0",
          "set train.weight_decay to e.g. 0.1")
  require(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 = no clipping)",
          "set train.grad_clip to e.g. 1.0")
  for field in ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
    require_positive_int(f"train.{field}", t[field])
  require(isinstance(t.seed, int), "train.seed", t.seed, "must be an integer", "set train.seed=0")
  require_positive_int("train.grad_accum_steps", t.grad_accum_steps)
  chunk = t.loss_chunk
  require(isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 0, "train.loss_chunk",
          chunk, "must be an integer >= 0 (0 = the whole window at once)",
          "set train.loss_chunk to e.g. 4096, or 0")
  require(t.sample_tokens >= 0, "train.sample_tokens", t.sample_tokens, "must be >= 0",
          "set train.sample_tokens to 0 to skip the final sample")
  eval_tokens = t.eval_tokens
  require(isinstance(eval_tokens, int) and not isinstance(eval_tokens, bool) and eval_tokens >= 0,
          "train.eval_tokens", eval_tokens, "must be an integer >= 0 (0 = the whole split)",
          "set train.eval_tokens to e.g. 100000, or 0")
  profile = t.profile_steps
  require(profile == "" or (isinstance(profile, str) and all(
      part.isdigit() for part in profile.split(":")) and 1 <= profile.count(":") + 1 <= 2
      and int(profile.split(":")[0]) >= 1), "train.profile_steps", profile,
      "must be '' or 'START:END' (steps, from 1)", "set train.profile_steps='10:12', or ''")
  require(isinstance(t.allow_new_data, bool), "train.allow_new_data",
          t.allow_new_data, "must be True or False", "set train.allow_new_data=False")

