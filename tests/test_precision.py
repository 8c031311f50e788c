"""The mixed-precision policy: bfloat16 compute, float32 where precision matters.

Parameters and optimizer state stay float32; matmuls run in bfloat16; the
residual stream, attention logits / softmax / log-sum-exp, π's gate priors,
BCMT's pooling and memory sums, the output logits and the loss are float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import fast_first
from flax import nnx

from efficient_lm import models
from efficient_lm.training import step as train_step
from tests.test_learning import TASKS, VOCAB, T, task_batch
from tests.test_models import tiny_model_config


def train_losses(name: str, dtype: str, steps: int = 30) -> list[float]:
  """30 AdamW steps on the copy task (the same batches for both dtypes)."""
  fields, d, reach = TASKS[name]
  cfg = tiny_model_config(name, vocab_size=VOCAB, seq_len=T, dtype=dtype, **fields)
  graphdef, params = nnx.split(models.create(cfg, rngs=nnx.Rngs(0)))
  tx = optax.adamw(3e-3)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    def loss_fn(params):
      logits = nnx.merge(graphdef, params)(batch["inputs"])
      assert logits.dtype == jnp.float32
      nll, weight = train_step.weighted_nll(logits, batch["targets"], batch["weights"])
      return nll / weight
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(0)
  losses = []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state, task_batch(rng, d, reach))
    losses.append(float(loss))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))  # parameters stay float32
  assert all(x.dtype in (jnp.float32, jnp.int32) for x in jax.tree.leaves(opt_state))
  return losses


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TASKS))
def test_bfloat16_training_tracks_float32(name):
  """Every model: 30 steps at model.dtype=bfloat16 end within 2% of the float32 loss (the mean of
  the last 5 steps, which have moved well away from the start)."""
  f32, bf16 = train_losses(name, "float32"), train_losses(name, "bfloat16")
  tail = lambda losses: float(np.mean(losses[-5:]))
  assert tail(f32) < f32[0] - 0.05, f"{name}: float32 did not train ({f32[0]:.3f} -> {tail(f32):.3f})"
  assert abs(tail(bf16) - tail(f32)) <= 0.02 * tail(f32), (name, tail(f32), tail(bf16))


@pytest.mark.parametrize("name", fast_first(["dense", "perceiver_ar"]))
def test_logits_are_not_rounded_to_bfloat16(name):
  """The head accumulates in float32: the bfloat16 model's logits keep float32 resolution."""
  fields, _, _ = TASKS[name]
  cfg = tiny_model_config(name, vocab_size=VOCAB, seq_len=T, dtype="bfloat16", **fields)
  logits = models.create(cfg, rngs=nnx.Rngs(0))(jnp.zeros((1, T), jnp.int32))
  assert logits.dtype == jnp.float32
  as_bf16 = np.asarray(logits.astype(jnp.bfloat16).astype(jnp.float32))
  assert np.any(np.asarray(logits) != as_bf16)  # values a bfloat16 array cannot hold


@pytest.mark.parametrize("dtype", fast_first(["float32", "bfloat16"], keep=(1,)))
def test_pi_gate_priors_are_exact_at_large_logits(dtype):
  """The π mixer's log-priors at gate logits of +-12 (gate_out bias, zero kernel) equal float64's
  log_sigmoid(+-12) to 1e-3 in either compute dtype, with finite, non-zero gradients; a sigmoid
  then a log would give log(1 - g) = log(0) or -13.8 with zero gradient there."""
  from efficient_lm.models import pi_attention
  cfg = tiny_model_config("pi_attention", dtype=dtype, window=4, period=4, num_skips=2)
  mixer = pi_attention.make_pi_mixer(cfg, 0, nnx.Rngs(0))
  z = np.array([12.0, -12.0, 12.0, -12.0], np.float32)
  mixer.gate_out.kernel[...] = jnp.zeros_like(mixer.gate_out.kernel[...])
  mixer.gate_out.bias[...] = jnp.asarray(z)
  x_BTD = jax.random.normal(jax.random.key(0), (1, 8, cfg.d_model))
  priors = mixer.priors(x_BTD)
  local, skip = priors["local_prior"], priors["skip_prior"]
  log_sigmoid = lambda a: -np.log1p(np.exp(-np.asarray(a, np.float64)))
  np.testing.assert_allclose(np.asarray(local[0, 0]), log_sigmoid(z), atol=1e-3)
  np.testing.assert_allclose(np.asarray(skip[0, 0]), log_sigmoid(-z), atol=1e-3)
  graphdef, state = nnx.split(mixer)
  grads = jax.grad(lambda s: jnp.sum(sum(nnx.merge(graphdef, s).priors(x_BTD).values())))(state)
  grad = np.asarray(grads["gate_out"]["bias"][...])
  assert np.all(np.isfinite(grad)) and np.all(np.abs(grad) > 1e-6)  # d/dz = 1 - 2 sigmoid(z)
