"""The jitted train and eval steps, the loss, and the randomness of a step.

Knows nothing of any particular model: the model returns logits `[B, T', V]`
for the last T' positions (T' = T but for Perceiver-AR) and is scored against
the shifted tokens, weighted. Randomness is a function of `train.seed` and the
step only (`dropout_key`), so a resumed run sees exactly what an uninterrupted
one would.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from efficient_lm.train_state import TrainState

# Dropout draws from its own stream: `nnx.Rngs(seed)` hands out fold_in(key(seed), i) for
# i = 0, 1, ... at initialization, so fold_in(key(seed), step) would repeat those keys.
_DROPOUT_STREAM = 0x64726F70  # "drop"


def dropout_key(seed: int, step: jax.Array) -> jax.Array:
  """The dropout key of training step `step` (no initializer ever sees it)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _DROPOUT_STREAM), step)


def weighted_nll(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
  """(summed NLL in nats, summed weights) over the positions the logits cover (the last T'),
  in float32 whatever the logits' dtype."""
  T = logits_BTV.shape[1]
  targets_BT, weights_BT = targets_BT[:, -T:], weights_BT[:, -T:]
  nll_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), targets_BT)
  return jnp.sum(nll_BT * weights_BT), jnp.sum(weights_BT)


def make_train_step(graphdef, tx, schedule, seed: int):
  """`train_step(state, batch) -> (state, metrics)`, jitted, the state donated."""

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    key = dropout_key(seed, state.step)

    def loss_fn(params):
      logits = nnx.merge(graphdef, params)(batch["inputs"], positions_BT=batch.get("positions"),
                                           dropout_key=key)
      nll, weight = weighted_nll(logits, batch["targets"], batch["weights"])
      return nll / jnp.maximum(weight, 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    step_metrics = {"loss": loss, "grad_norm": optax.global_norm(grads),
                    "learning_rate": schedule(state.step)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), step_metrics

  return jax.jit(train_step, donate_argnums=0)


def make_eval_step(graphdef):
  """`eval_step(params, batch) -> (summed NLL, summed weights)`, jitted."""

  @jax.jit
  def eval_step(params, batch):
    logits = nnx.merge(graphdef, params)(batch["inputs"], positions_BT=batch.get("positions"))
    return weighted_nll(logits, batch["targets"], batch["weights"])

  return eval_step
