"""π-Attention and sliding-window models: configs, validation, training."""


import pytest

from conftest import build, load_config
from efficient_lm import models
from efficient_lm.config.errors import ConfigError
from efficient_lm.families import pi_attention
from efficient_lm.models import pi_attention as pi_mixers
from efficient_lm.training import prepare as config_check
from test_models import tiny_model_config


@pytest.mark.parametrize("name,preset", [("pi_attention", None), ("pi_attention", "doubling"),
                                         ("pi_attention", "paper"), ("sliding_window", None)])
def test_configs_are_valid(name, preset):
  config = load_config(name, preset)
  config_check.validate(build(config))
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


def test_bad_gate_is_named():
  with pytest.raises(ConfigError, match=r"^model\.gate='constant' is not a known gate.*'fixed'"):
    models.validate(tiny_model_config("pi_attention", gate="constant"))


def test_fixed_gate_is_the_learned_gate_at_logit_zero_and_has_no_parameters():
  """model.gate='fixed': g = 0.5 for every token and head (the window and the skips weighed
  equally in one softmax), no gate parameters; equal to the learned mixer whose gate outputs 0.
  With no skips the gate's prior is the same for every key and cancels: the sliding window."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  cfg = tiny_model_config("pi_attention", window=4, period=4, num_skips=2)
  learned = pi_mixers.make_pi_mixer(cfg, 0, nnx.Rngs(0))
  fixed = pi_mixers.make_pi_mixer(tiny_model_config("pi_attention", window=4, period=4, num_skips=2,
                                                       gate="fixed"), 0, nnx.Rngs(0))
  assert fixed.gate_in is None and fixed.gate_out is None and learned.gate_in is not None
  count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  G = cfg.gate_hidden
  assert count(learned) - count(fixed) == (32 * G + G) + (G * 4 + 4)  # the gate MLP's
  x_BTD = jax.random.normal(jax.random.key(1), (2, 32, 32))
  positions_BT = jax.numpy.broadcast_to(jax.numpy.arange(32), (2, 32))
  fixed.attn = learned.attn  # the same projections
  assert np.allclose(fixed.gate(x_BTD), 0.5)
  assert not np.allclose(learned(x_BTD, positions_BT), fixed(x_BTD, positions_BT), atol=1e-4)
  learned.gate_out.kernel[...] = 0.0 * learned.gate_out.kernel[...]
  learned.gate_out.bias[...] = 0.0 * learned.gate_out.bias[...]
  np.testing.assert_allclose(learned(x_BTD, positions_BT), fixed(x_BTD, positions_BT), atol=1e-5)
  no_skips = pi_mixers.make_pi_mixer(tiny_model_config("pi_attention", window=4, num_skips=0), 0,
                                        nnx.Rngs(0))
  window = pi_mixers.make_sliding_window_mixer(tiny_model_config("sliding_window", window=4), 0,
                                                  nnx.Rngs(0))
  no_skips.attn = window.attn
  np.testing.assert_allclose(no_skips(x_BTD, positions_BT), window(x_BTD, positions_BT), atol=1e-5)
