"""π-Attention and sliding-window models: configs, validation, training."""


import pytest

from conftest import load_config
from efficient_lm import config_check
from efficient_lm import models
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
