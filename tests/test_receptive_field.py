"""The receptive-field tool against the gradients of small π and sliding-window models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first
from flax import nnx

from efficient_lm import models
from experiments import receptive_field
from test_models import tiny_model_config


def gradient_support(cfg) -> np.ndarray:
  """Input positions j with d(logits at the last position) / d(input j) != 0."""
  model = models.create(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (1, cfg.seq_len), 0, cfg.vocab_size)
  graphdef, params = nnx.split(model)

  @jax.jit
  def grad(params, x_BTD):
    out = lambda x, p: jnp.sum(nnx.merge(graphdef, p).from_embeddings(x)[0, -1])
    return jax.grad(out, argnums=(0, 1))(x_BTD, params)[0]

  return np.linalg.norm(np.asarray(grad(params, model.embed_tokens(tokens))[0]), axis=-1) > 0


@pytest.mark.parametrize("name,fields", fast_first([
    ("pi_attention", dict(window=3, period=5, num_skips=2, period_schedule="constant")),
    ("pi_attention", dict(window=2, period=3, num_skips=2, period_schedule="doubling")),
    ("pi_attention", dict(window=4, period=2, num_skips=3, period_schedule="constant")),  # P < W
    ("sliding_window", dict(window=4)),
], keep=(1,)))
def test_tool_matches_gradients(name, fields):
  cfg = tiny_model_config(name, seq_len=48, num_layers=3, **fields)
  expected = receptive_field.receptive_field(
      cfg.seq_len, window=cfg.window, period=getattr(cfg, "period", 1),
      num_skips=getattr(cfg, "num_skips", 0), schedule=getattr(cfg, "period_schedule", "constant"),
      num_layers=cfg.num_layers)
  assert 0 < expected.sum() < cfg.seq_len  # a field that says something at this size
  np.testing.assert_array_equal(gradient_support(cfg), expected)


def test_doubling_reaches_farther_than_constant_and_window():
  common = dict(seq_len=4096, window=16, period=16, num_skips=2, num_layers=6)
  sizes = {s: receptive_field.receptive_field(schedule=s, **common).sum() for s in ("constant", "doubling")}
  window_only = receptive_field.receptive_field(**{**common, "num_skips": 0}, schedule="constant").sum()
  assert window_only == 6 * 15 + 1
  assert window_only < sizes["constant"] < sizes["doubling"]
