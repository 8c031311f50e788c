"""BCMT and HOnly: causality at block boundaries, streaming decoding, config checks, training."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import load_config
from efficient_lm import models
from efficient_lm import train
from efficient_lm.models import decoder
from efficient_lm.validation import ConfigError
from test_models import tiny_model_config

L = 8  # block size of the tiny models: seq_len 32 is 4 blocks


BOUNDARIES = (L - 1, L, 2 * L - 1, 2 * L, 3 * L, 4 * L - 1)  # last and first tokens of blocks


@functools.lru_cache(maxsize=None)
def grads_of_output(name, ts=BOUNDARIES):
  """{t: |d logits[t] / d x[s]| over s} for a tiny model with blocks of L (computed once per model)."""
  cfg = tiny_model_config(name, block_size=L)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (1, cfg.seq_len), 0, cfg.vocab_size)
  x_BTD = model.embed_tokens(tokens)
  graphdef, params = nnx.split(model)

  @jax.jit
  def grad_norms(params, x_BTD, t):
    out = lambda x, p: jnp.sum(nnx.merge(graphdef, p).decode(x)[0, t])
    return jnp.linalg.norm(jax.grad(out, argnums=(0, 1))(x_BTD, params)[0][0], axis=-1)

  return {t: np.asarray(grad_norms(params, x_BTD, t)) for t in ts}


@pytest.mark.parametrize("name", ["bcmt", "honly"])
def test_causal_at_block_boundaries(name):
  """No output depends on a later token, in particular not the last token of a block on the next."""
  for t, norms in grads_of_output(name).items():
    assert np.all(norms[t + 1:] == 0.0), f"{name}: output {t} depends on {np.nonzero(norms[t + 1:])[0] + t + 1}"
    assert norms[t] > 0.0


def test_memory_reaches_earlier_blocks_and_honly_does_not():
  """BCMT's first token of block b sees every earlier block through the memory; HOnly sees only itself."""
  bcmt, honly = grads_of_output("bcmt"), grads_of_output("honly")
  for t in (L, 3 * L):
    assert np.all(bcmt[t][:t] > 0.0), f"bcmt: output {t} misses {np.nonzero(bcmt[t][:t] == 0)[0]}"
    assert np.all(honly[t][:t] == 0.0)


def decode_all(model, tokens_BT):
  graphdef, params = nnx.split(model)

  @jax.jit
  def step(params, tokens_B, cache, position):
    return nnx.merge(graphdef, params).decode_step(tokens_B, cache, position)

  cache = model.init_cache(*tokens_BT.shape)
  shapes = jax.tree.map(jnp.shape, cache)
  logits = []
  for t in range(tokens_BT.shape[1]):
    logits_BV, cache = step(params, tokens_BT[:, t], cache, t)
    logits.append(logits_BV)
  assert jax.tree.map(jnp.shape, cache) == shapes  # the state does not grow with the length
  return jnp.stack(logits, axis=1)


@pytest.mark.parametrize("name,position,scanned", [
    ("bcmt", "rope", True), ("bcmt", "learned", False), ("honly", "rope", True)])
def test_streaming_decoding_equals_forward(name, position, scanned):
  """Token-by-token logits equal the full pass's at every position: 4 blocks and a ragged fifth."""
  cfg = tiny_model_config(name, block_size=L, position=position, seq_len=40)
  entry = models.REGISTRY[name]
  model = decoder.Decoder(cfg, lambda layer, rngs: entry.make_mixer(cfg, layer, rngs),
                          identical_layers=scanned, rngs=nnx.Rngs(0))
  tokens_BT = jax.random.randint(jax.random.key(2), (2, 4 * L + 3), 0, cfg.vocab_size)
  full_BTV = jax.jit(lambda m, x: m(x))(model, tokens_BT)
  np.testing.assert_allclose(decode_all(model, tokens_BT), full_BTV, atol=2e-5, rtol=2e-5)


def test_memory_changes_the_logits():
  """Guards the decoding test: with the memory's projection zeroed, logits after block 0 change."""
  cfg = tiny_model_config("bcmt", block_size=L)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  tokens_BT = jax.random.randint(jax.random.key(2), (1, cfg.seq_len), 0, cfg.vocab_size)
  before = model(tokens_BT)
  model.blocks.mixer.memory_proj.kernel[...] = jnp.zeros_like(model.blocks.mixer.memory_proj.kernel[...])
  after = model(tokens_BT)
  np.testing.assert_allclose(before[:, :L], after[:, :L], atol=1e-6)
  assert np.abs(before[:, L:] - after[:, L:]).max() > 1e-3


@pytest.mark.parametrize("name,overrides,field", [
    ("bcmt", dict(block_size=12), "model.block_size"),
    ("bcmt", dict(block_size=0), "model.block_size"),
    ("honly", dict(block_size=64), "model.block_size"),
    ("bcmt", dict(alpha=1.0), "model.alpha"),
    ("bcmt", dict(alpha=0.0), "model.alpha"),
])
def test_validation_names_the_field(name, overrides, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as error:
    models.validate(tiny_model_config(name, **overrides))
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("preset,name,block", [
    (None, "bcmt", 256), ("64", "bcmt", 64), ("128", "bcmt", 128), ("256", "bcmt", 256),
    ("512", "bcmt", 512), ("honly", "honly", 256), ("honly128", "honly", 128)])
def test_presets(preset, name, block):
  config = load_config("bcmt", preset)
  assert (config.model.name, config.model.block_size) == (name, block)
  assert config.data.seq_len * config.data.batch_size == load_config("dense").data.seq_len * 8
  models.validate(config.model)


def test_unknown_preset_is_refused():
  with pytest.raises(ValueError, match="honly128"):
    load_config("bcmt", "100")


def test_tiny_training_run_loss_falls(tiny_config, tmp_path):
  config = tiny_config("bcmt", num_steps=30, eval_every=30, checkpoint_every=30)
  config.model.block_size = L
  summary = train.train_and_evaluate(config, str(tmp_path))
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
  assert losses[-1] < losses[0] - 0.5
  assert np.isfinite(summary["eval_loss"])
