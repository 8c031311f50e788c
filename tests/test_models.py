"""Every registered model: shapes, causality through gradients, dropout, scan vs unrolled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import families
from conftest import build, fast_first, load_config
from flax import nnx

from efficient_lm import models
from efficient_lm.config.errors import ConfigError
from efficient_lm.config.model import ModelConfig
from efficient_lm.models import decoder


# Each model's own fields at tiny sizes (seq_len 32), chosen so that every part of the model is
# exercised (several blocks, skips that land, windows shorter than the context): its family's
# settings for the tests (tests/families/<its module>.py).
FAMILY_FIELDS = families.merged("FIELDS")


# The config file (and preset) each model's defaults come from: the one its family lists for
# `--help` (`ModelEntry.listing`).
CONFIG_OF = {name: tuple(entry.listing[0].split(":")) for name, entry in models.REGISTRY.items()}


def test_every_model_has_its_family_test_settings():
  """Every registered model has tiny fields in its family's tests/families/ module, and nothing
  there names a model that is not registered."""
  assert sorted(FAMILY_FIELDS) == sorted(models.REGISTRY), (
      "declare FIELDS for each model in tests/families/<the family's module>.py")
  for module in families.modules():
    assert f"efficient_lm.families.{module.__name__.rsplit('.', 1)[1]}" in {
        models.REGISTRY[m].config.__module__ for m in getattr(module, "FIELDS", {})}, module


def tiny_model_config(name: str = "dense", **overrides) -> ModelConfig:
  """The typed model section of the model's file in configs/, at tiny sizes (FAMILY_FIELDS), with
  `overrides` (`seq_len` and `vocab_size` the data's, which the model's follow): built as a
  command line builds it (`config.run.build`), so a field its checks refuse is a ConfigError."""
  config = load_config(*CONFIG_OF.get(name, (name,)))
  assert config.model.name == name, (name, config.model.name)
  fields = dict(vocab_size=64, seq_len=32, d_model=32, num_layers=2, num_heads=4, mlp_ratio=2,
                **FAMILY_FIELDS.get(name, {}))
  fields.update(overrides)
  config.data.update(vocab_size=fields.pop("vocab_size"), seq_len=fields.pop("seq_len"))
  config.model.update(fields)
  return build(config).model


# The fast tier: the three families and the dense baseline; the whole suite: every model.
@pytest.mark.parametrize("name", fast_first(sorted(models.REGISTRY), keep=(
    sorted(models.REGISTRY).index(n) for n in ("bcmt", "dense", "ecp"))))
@pytest.mark.parametrize("position", fast_first(["rope", "learned"]))
def test_causal_through_gradients(name, position):
  """d logits[t] / d embedding[s] is zero for every s > t, and non-zero for some s <= t."""
  cfg = tiny_model_config(name, position=position, tie_embeddings=position == "rope")
  model = models.create(cfg, rngs=nnx.Rngs(0))
  T = cfg.seq_len
  tokens = jax.random.randint(jax.random.key(1), (1, T), 0, cfg.vocab_size)
  x_BTD = model.embed_tokens(tokens)
  Tp = model(tokens).shape[1]  # models may return logits for the last Tp positions only
  graphdef, params = nnx.split(model)

  @jax.jit
  def grad_of_output(params, x_BTD, t):
    out = lambda x, p: jnp.sum(nnx.merge(graphdef, p).from_embeddings(x)[0, t - (T - Tp)])
    return jax.grad(out, argnums=(0, 1))(x_BTD, params)[0]

  for t in sorted({T - Tp, T - Tp + 1, (2 * T - Tp) // 2, T - 2, T - 1}):
    norms = np.linalg.norm(np.asarray(grad_of_output(params, x_BTD, t)[0]), axis=-1)
    assert np.all(norms[t + 1:] == 0.0), f"{name}: output {t} depends on inputs {np.nonzero(norms[t + 1:])[0] + t + 1}"
    assert norms[t] > 0.0, f"{name}: output {t} ignores its own input"


@pytest.mark.parametrize("name", fast_first(sorted(models.REGISTRY), keep=(sorted(models.REGISTRY).index("dense"),)))
def test_logits_shape_and_dtype(name):
  cfg = tiny_model_config(name)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  logits = model(jnp.zeros((2, cfg.seq_len), jnp.int32))
  assert logits.shape[0] == 2 and logits.shape[2] == cfg.vocab_size
  assert 1 <= logits.shape[1] <= cfg.seq_len
  assert logits.dtype == jnp.float32
  assert np.all(np.isfinite(logits))


@pytest.mark.slow
def test_scanned_equals_unrolled():
  """The nnx.scan path and the per-layer list compute the same function."""
  cfg = tiny_model_config()
  entry = models.REGISTRY["dense"]
  make = lambda layer, rngs: entry.make_mixer(cfg, layer, rngs)
  scanned = decoder.Decoder(cfg, make, identical_layers=True, rngs=nnx.Rngs(0))
  unrolled = decoder.Decoder(cfg, make, identical_layers=False, rngs=nnx.Rngs(1))
  # Copy the stacked parameters into the list of blocks.
  _, stacked = nnx.split(scanned.blocks)
  for i, block in enumerate(unrolled.blocks):
    nnx.update(block, jax.tree.map(lambda x: x[i], stacked))
  unrolled.embed.embedding[...] = scanned.embed.embedding[...]
  unrolled.final_norm.scale[...] = scanned.final_norm.scale[...]
  tokens = jax.random.randint(jax.random.key(2), (2, cfg.seq_len), 0, cfg.vocab_size)
  np.testing.assert_allclose(scanned(tokens), unrolled(tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_dropout_is_keyed():
  cfg = tiny_model_config(dropout=0.5)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
  a = model(tokens, dropout_key=jax.random.key(0))
  b = model(tokens, dropout_key=jax.random.key(0))
  c = model(tokens, dropout_key=jax.random.key(1))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  np.testing.assert_array_equal(model(tokens), model(tokens))  # no key: no dropout


@pytest.mark.parametrize("overrides,field", [
    (dict(name="nope"), "model.name"),
    (dict(d_model=30), "model.d_model"),
    (dict(num_heads=0), "model.num_heads"),
    (dict(dropout=1.0), "model.dropout"),
    (dict(position="alibi"), "model.position"),
    (dict(dtype="float16"), "model.dtype"),
])
def test_validation_names_the_field(overrides, field):
  """A model section's bad field is a ConfigError naming it, as the RunConfig is built (nothing
  below takes an unchecked one)."""
  config = load_config("dense")
  config.model.update(overrides)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    build(config)
