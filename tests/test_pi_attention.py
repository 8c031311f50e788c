"""π-Attention and sliding-window models: configs, validation, training."""

import json
import os

import pytest

from conftest import load_config
from efficient_lm import config_check
from efficient_lm import models
from efficient_lm import train
from efficient_lm.models import pi_attention
from efficient_lm.validation import ConfigError
from test_models import tiny_model_config


@pytest.mark.parametrize("name,preset", [("pi_attention", None), ("pi_attention", "doubling"),
                                         ("pi_attention", "paper"), ("sliding_window", None)])
def test_configs_are_valid(name, preset):
  config = load_config(name, preset)
  config_check.validate(config)
  assert config.model.name == name


def test_doubling_schedule_periods():
  cfg = load_config("pi_attention", "doubling").model
  assert [pi_attention.layer_period(cfg, l) for l in range(4)] == [64, 128, 256, 512]
  cfg = load_config("pi_attention").model
  assert {pi_attention.layer_period(cfg, l) for l in range(4)} == {cfg.period}


def test_unknown_preset_is_refused():
  with pytest.raises(ValueError, match="unknown preset"):
    load_config("pi_attention", "huge")


@pytest.mark.parametrize("field,value", [("window", 0), ("period", 0), ("num_skips", -1),
                                         ("period_schedule", "tripling"), ("gate_hidden", 0)])
def test_bad_field_is_named(field, value):
  with pytest.raises(ConfigError, match=rf"^model\.{field}={value!r}"):
    models.validate(tiny_model_config("pi_attention", **{field: value}))


@pytest.mark.parametrize("name", ["pi_attention", "sliding_window"])
def test_tiny_run_learns(name, tiny_config, tmp_path):
  config = tiny_config(name, num_steps=30, eval_every=30, checkpoint_every=30)
  config.model.update(dict(window=8, **({"period": 8, "num_skips": 2} if name == "pi_attention" else {})))
  summary = train.train_and_evaluate(config, str(tmp_path))
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
  assert losses[-1] < losses[0] - 0.5
  assert summary["eval_bits_per_byte"] > 0
