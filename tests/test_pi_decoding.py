"""Cached decoding of π-Attention and sliding window equals the full forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from efficient_lm import models
from test_models import tiny_model_config


@pytest.mark.parametrize("name,fields", [
    ("pi_attention", dict(window=3, period=4, num_skips=3, period_schedule="doubling")),
    ("pi_attention", dict(window=5, period=2, num_skips=4, period_schedule="constant")),  # P < W
    ("sliding_window", dict(window=6)),
])
def test_decoding_token_by_token_equals_forward(name, fields):
  cfg = tiny_model_config(name, seq_len=40, **fields)
  model = models.create(cfg, rngs=nnx.Rngs(3))
  tokens = jax.random.randint(jax.random.key(4), (2, cfg.seq_len), 0, cfg.vocab_size)
  expected = model(tokens)
  graphdef, params = nnx.split(model)

  @jax.jit
  def decode_all(params, tokens):
    def body(carry, t):  # params ride in the carry so the module is built at the body's level
      params, cache = carry
      logits, cache = nnx.merge(graphdef, params).decode_step(tokens[:, t], cache, t)
      return (params, cache), logits

    cache = nnx.merge(graphdef, params).init_cache(tokens.shape[0])
    _, logits_TBV = jax.lax.scan(body, (params, cache), jnp.arange(tokens.shape[1]))
    return jnp.swapaxes(logits_TBV, 0, 1)

  np.testing.assert_allclose(decode_all(params, tokens), expected, atol=2e-4, rtol=2e-4)


def test_cache_size_does_not_grow_with_context():
  cfg = tiny_model_config("pi_attention", window=4, period=8, num_skips=2,
                          period_schedule="doubling", num_layers=3)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  spans = [leaf.shape[1] for leaf in jax.tree.leaves(model.init_cache(1)) if leaf.ndim == 4]
  # Layer periods 8, 16, 32: the farthest skip is 2 * period back; k and v per layer.
  assert spans == [17, 17, 33, 33, 65, 65]
