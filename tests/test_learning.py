"""A task only attention solves: predict the token d positions back.

Inputs are uniform random tokens, the target at position t is the input at
t - d, for a d inside each model's reach (a skip distance for π, the previous
piece for ECP, inside the block for BCMT, from the history for Perceiver-AR).
No unigram or bigram statistics help, so a model whose attention is broken
stays at chance (1 / VOCAB). Every model must reach >= 0.9 accuracy on fresh
data, and the same model with its attention output zeroed (every attention's
output projection held at 0) must stay near chance: the test checks both.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax import nnx

import families
from efficient_lm import models
from efficient_lm.training import step as train_step
from tests.test_models import tiny_model_config

VOCAB, T, BATCH = 16, 32, 16

# model name -> (its fields, the distance d, which positions t are in reach of t - d), and the
# registered models with no task, each with one line saying why no copy-d-back task fits it: each
# family's own (tests/families/<its module>.py; docs/adding_a_model.md, The tests). Every
# registered model is in TASKS or NO_TASK, never both.
TASKS = families.merged("TASKS")
NO_TASK: dict[str, str] = families.merged("NO_TASK")


def task_batch(rng: np.random.Generator, d: int, reach) -> dict:
  x = rng.integers(0, VOCAB, (BATCH, T)).astype(np.int32)
  y = np.roll(x, d, axis=1)
  weights = np.broadcast_to(np.array([reach(t) for t in range(T)], np.float32), (BATCH, T))
  return {"inputs": x, "targets": y, "weights": weights.copy()}


def zero_attention_outputs(params, zeroed):
  """Every attention's output projection kernel set to 0 where `zeroed` (the mixer then adds
  nothing); `zeroed` is traced, so the model and its ablation share one compiled step."""
  def zero(path, x):
    keys = [getattr(p, "key", None) for p in path]
    is_out = "out" in keys and keys[keys.index("out") + 1] == "kernel"
    return jnp.where(zeroed, jnp.zeros_like(x), x) if is_out else x
  return jax.tree_util.tree_map_with_path(zero, params)


STEPS = 300  # the schedule's length; the ablation stops halfway


def learner(name: str):
  """learn(zeroed, steps) -> accuracy on fresh data after `steps` updates of the model `name`."""
  fields, d, reach = TASKS[name]
  cfg = tiny_model_config(name, vocab_size=VOCAB, seq_len=T, **fields)
  graphdef, initial = nnx.split(models.create(cfg, rngs=nnx.Rngs(0)))
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 20, STEPS, 1e-3), weight_decay=0.0)

  def loss_fn(params, batch):
    logits = nnx.merge(graphdef, params)(batch["inputs"])
    nll, weight = train_step.weighted_nll(logits, batch["targets"], batch["weights"])
    return nll / weight

  @jax.jit
  def step(params, opt_state, batch, zeroed):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return zero_attention_outputs(optax.apply_updates(params, updates), zeroed), opt_state

  @jax.jit
  def correct(params, batch):
    logits = nnx.merge(graphdef, params)(batch["inputs"])
    P = logits.shape[1]
    hit = jnp.argmax(logits, -1) == batch["targets"][:, -P:]
    w = batch["weights"][:, -P:]
    return jnp.sum(hit * w), jnp.sum(w)

  def learn(zeroed: bool, steps: int) -> float:
    zeroed = jnp.asarray(zeroed)
    params = zero_attention_outputs(initial, zeroed)
    opt_state = tx.init(params)
    rng = np.random.default_rng(1)
    for _ in range(steps):
      params, opt_state = step(params, opt_state, task_batch(rng, d, reach), zeroed)
    hits, total = map(sum, zip(*[correct(params, task_batch(rng, d, reach)) for _ in range(8)]))
    return float(hits) / float(total)

  return learn


@pytest.fixture(autouse=True)
def optimized_code():
  """XLA's optimisations back on (conftest turns them off for compile-bound tests): 450 steps
  of training make these tests bound by running the code, not compiling it (measured 30% faster)."""
  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", previous)


def test_every_registered_model_has_a_task_or_a_reason():
  missing = set(models.REGISTRY) - set(TASKS) - set(NO_TASK)
  assert not missing, (f"{sorted(missing)}: declare TASKS, or a one-line reason in NO_TASK, in "
                       "tests/families/<the family's module>.py")
  stale = (set(TASKS) | set(NO_TASK)) - set(models.REGISTRY)
  assert not stale, (f"{sorted(stale)}: not registered; remove them from tests/families/ "
                     "(TASKS / NO_TASK)")
  assert not set(TASKS) & set(NO_TASK), "a model is in both TASKS and NO_TASK"
  assert all(isinstance(r, str) and r.strip() for r in NO_TASK.values()), "a NO_TASK without reason"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_model_copies_from_d_back_and_fails_without_attention(name):
  learn = learner(name)
  accuracy = learn(zeroed=False, steps=STEPS)
  ablated = learn(zeroed=True, steps=STEPS // 2)
  assert accuracy >= 0.9, f"{name}: accuracy {accuracy:.3f} on a task its attention can solve"
  assert ablated < 2.5 / VOCAB, f"{name}: {ablated:.3f} without attention (chance {1 / VOCAB:.3f})"
