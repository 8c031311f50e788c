"""The optimizer: which parameters decay and by how much, the two schedules, the dropout stream."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from efficient_lm import models
from efficient_lm.state import optimizer
from efficient_lm.training import step as train_step
from tests.conftest import load_config
from tests.test_models import tiny_model_config


def train_config(**overrides) -> ml_collections.ConfigDict:
  config = load_config("pi_attention").train
  config.update(overrides)
  return config


def flat(tree) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.slow
def test_zero_gradients_shrink_kernels_by_lr_times_decay_and_leave_norms_and_biases():
  """60 AdamW steps with zero gradients: every kernel and embedding is multiplied by
  prod(1 - lr_t * wd); norm scales and biases do not move."""
  t = train_config(num_steps=60, warmup_steps=10)
  params = nnx.state(models.create(tiny_model_config("pi_attention"), rngs=nnx.Rngs(0)))
  tx, schedule = optimizer.make_optimizer(t)
  opt_state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  new = params
  for _ in range(60):
    updates, opt_state = tx.update(zeros, opt_state, new)
    new = optax.apply_updates(new, updates)
  factor = np.prod([1.0 - float(schedule(s)) * t.weight_decay for s in range(60)])
  assert factor < 0.995  # 0.65% at the default rate and decay: far above the tolerance below
  before, after = flat(params), flat(new)
  decayed = [k for k in before if "kernel" in k or "embedding" in k]
  kept = [k for k in before if "scale" in k or "bias" in k]
  assert decayed and kept and len(decayed) + len(kept) == len(before)
  for k in decayed:
    np.testing.assert_allclose(after[k], before[k] * factor, rtol=1e-5, atol=1e-7, err_msg=k)
  for k in kept:
    np.testing.assert_array_equal(after[k], before[k], err_msg=k)


@pytest.mark.parametrize("name", sorted(models.REGISTRY))
def test_decay_mask_is_the_matrices_of_every_model(name):
  cfg = tiny_model_config(name, position="learned", tie_embeddings=False)
  params = nnx.state(models.create(cfg, rngs=nnx.Rngs(0)))
  mask = flat(optimizer.decay_mask(params))
  for key, decays in mask.items():
    expected = any(key.endswith(f"['{n}'].value") for n in optimizer.DECAYED_NAMES)
    assert bool(decays) == expected, key
  assert any(mask.values()) and not all(mask.values())
  assert mask["['embed']['embedding'].value"] and mask["['pos_embed']['embedding'].value"]
  assert mask["['head']['kernel'].value"] and not mask["['final_norm']['scale'].value"]


def test_cosine_schedule():
  t = train_config(num_steps=100, warmup_steps=10, learning_rate=1.0)
  schedule = optimizer.learning_rate_schedule(t)
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(0.5)
  assert float(schedule(10)) == pytest.approx(1.0)
  assert float(schedule(100)) == pytest.approx(optimizer.END_FRACTION)
  assert float(schedule(55)) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-5)  # half way down


def test_wsd_schedule_extends_without_changing_the_rates_so_far():
  short = optimizer.learning_rate_schedule(train_config(
      schedule="wsd", num_steps=100, warmup_steps=10, decay_fraction=0.2, learning_rate=1.0))
  long = optimizer.learning_rate_schedule(train_config(
      schedule="wsd", num_steps=200, warmup_steps=10, decay_fraction=0.2, learning_rate=1.0))
  assert float(short(5)) == pytest.approx(0.5)
  assert [float(short(s)) for s in (10, 50, 80)] == pytest.approx([1.0, 1.0, 1.0])
  assert float(short(90)) == pytest.approx(1.0 - 0.9 * 0.5)  # linear decay over the last 20
  assert float(short(100)) == pytest.approx(optimizer.END_FRACTION)
  # Extending during the stable phase changes nothing before the old decay start ...
  np.testing.assert_allclose([float(long(s)) for s in range(80)], [float(short(s)) for s in range(80)])
  # ... whereas the cosine schedule's rate at step 70 moves when num_steps doubles.
  cos = lambda n: optimizer.learning_rate_schedule(train_config(num_steps=n, warmup_steps=10,
                                                                learning_rate=1.0))
  assert abs(float(cos(200)(70)) - float(cos(100)(70))) > 0.2


def test_parameter_name_skips_the_value_attribute():
  params = nnx.state(models.create(tiny_model_config(), rngs=nnx.Rngs(0)))
  names = {optimizer.parameter_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
  assert names == {"kernel", "embedding", "scale", "bias"}


def test_dropout_keys_are_not_initializer_keys():
  """fold_in(key(seed), step) would be the step-th key `nnx.Rngs(seed)` gives the initializers."""
  seed = 3
  rngs = nnx.Rngs(seed)
  init_keys = {tuple(np.asarray(jax.random.key_data(rngs())).tolist()) for _ in range(300)}
  dropout_keys = {tuple(np.asarray(jax.random.key_data(train_step.dropout_key(seed, s))).tolist())
                  for s in range(300)}
  assert len(dropout_keys) == 300 and not init_keys & dropout_keys
  # The old key scheme would have collided: the check above can fail.
  old = {tuple(np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), s))).tolist())
         for s in range(300)}
  assert init_keys & old


@pytest.mark.slow
def test_sample_does_not_import_the_training_loop():
  code = "import sys, efficient_lm.sample; print('efficient_lm.training.loop' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"
