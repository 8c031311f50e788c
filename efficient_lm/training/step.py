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

from efficient_lm.parallel import sharding
from efficient_lm.state.train_state import TrainState

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


def token_nll(model, x_BTD: jax.Array, targets_BT: jax.Array, chunk: int, *,
              predictions: bool = False) -> tuple[jax.Array, ...]:
  """(per-position NLL `[B, T]` float32,) of `targets_BT`'s last T under `model.logits(x_BTD)`,
  and with `predictions` the logits' argmax `[B, T]` too: the final norm, the head and the
  cross-entropy over chunks of `chunk` positions in a `lax.scan`, each chunk rematerialized in
  the backward pass, so no `[B, T, V]` logits exist when `chunk` > 0. The one scorer of the
  training loss, the evaluation and every readout."""
  B, T, _ = x_BTD.shape
  targets_BT = targets_BT[:, -T:]

  def score(x_BCD, t_BC):
    logits_BCV = model.logits(x_BCD).astype(jnp.float32)
    nll_BC = optax.softmax_cross_entropy_with_integer_labels(logits_BCV, t_BC)
    return (nll_BC, jnp.argmax(logits_BCV, axis=-1).astype(jnp.int32)) if predictions else (nll_BC,)

  if not chunk or chunk >= T:
    return score(x_BTD, targets_BT)
  n = -(-T // chunk)
  pad = n * chunk - T
  split = lambda a: jnp.moveaxis(jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)).reshape(
      B, n, chunk, *a.shape[2:]), 1, 0)
  _, outs = jax.lax.scan(lambda carry, xs: (carry, jax.checkpoint(score)(*xs)), None,
                         (split(x_BTD), split(targets_BT)))
  return tuple(jnp.moveaxis(o_nBC, 0, 1).reshape(B, n * chunk)[:, :T] for o_nBC in outs)


def chunked_weighted_nll(model, x_BTD: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array,
                         chunk: int) -> tuple[jax.Array, jax.Array]:
  """`weighted_nll(model.logits(x), ...)` over chunks of `chunk` positions (`token_nll`): never
  `[B, T, V]` logits when `chunk` > 0. Equal to the unchunked loss."""
  T = x_BTD.shape[1]
  (nll_BT,) = token_nll(model, x_BTD, targets_BT, chunk)
  weights_BT = weights_BT[:, -T:]
  return jnp.sum(nll_BT * weights_BT), jnp.sum(weights_BT)


def model_nll(model, batch: dict, *, loss_chunk: int = 0, dropout_key=None
              ) -> tuple[jax.Array, jax.Array]:
  """(summed NLL, summed weight) of a batch under `model` (chunked over positions when asked)."""
  x_BTD = model.hidden(batch["inputs"], positions_BT=batch.get("positions"),
                       segment_ids_BT=batch.get("segment_ids"), dropout_key=dropout_key)
  return chunked_weighted_nll(model, x_BTD, batch["targets"], batch["weights"], loss_chunk)


def make_train_step(graphdef, tx, schedule, seed: int, *, state_shardings=None,
                    batch_sharding=None, grad_accum_steps: int = 1, loss_chunk: int = 0,
                    activation_rules: dict | None = None):
  """`train_step(state, batch) -> (state, metrics)`, jitted, the state donated.

  With shardings (`train_state.Built.shardings`, `sharding.batch_sharding`) the
  step is jitted with them as in and out shardings: the state stays where it
  was created, the batch is split over the batch axes. `grad_accum_steps` = k
  splits the batch into k microbatches (rows j with j % k == i: a device's own
  rows, so no data moves) whose summed NLL and gradients a `lax.scan`
  accumulates: the same loss and gradients as the whole batch in one pass, for
  the memory of one microbatch. `activation_rules` (`sharding.parse_activation_rules`;
  None = the defaults) place the model's activations while it is traced.
  """

  def nll_and_weight(params, batch, key):
    return model_nll(nnx.merge(graphdef, params), batch, loss_chunk=loss_chunk, dropout_key=key)

  def summed_grads(params, batch, key):
    """(summed NLL, summed weight, gradient of the summed NLL)."""
    nll = nll_and_weight  # (value, aux) = (summed NLL, summed weight)
    if grad_accum_steps == 1:
      (total, weight), grads = jax.value_and_grad(nll, has_aux=True)(params, batch, key)
      return total, weight, grads
    k = grad_accum_steps
    micro = jax.tree.map(lambda x: jnp.moveaxis(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 1, 0),
                         batch)

    def body(carry, i_and_batch):
      i, microbatch = i_and_batch
      total, weight, grads = carry
      (t, w), g = jax.value_and_grad(nll, has_aux=True)(params, microbatch,
                                                         jax.random.fold_in(key, i))
      return (total + t, weight + w, jax.tree.map(jnp.add, grads, g)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (total, weight, grads), _ = jax.lax.scan(
        body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros),
        (jnp.arange(k), micro))
    return total, weight, grads

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    key = dropout_key(seed, state.step)
    total, weight, grads = summed_grads(state.params, batch, key)
    scale = 1.0 / jnp.maximum(weight, 1.0)
    loss = total * scale
    grads = jax.tree.map(lambda g: g * scale, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    step_metrics = {"loss": loss, "grad_norm": optax.global_norm(grads),
                    "learning_rate": schedule(state.step)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), step_metrics

  if state_shardings is None:
    return jax.jit(train_step, donate_argnums=0)
  mesh = batch_sharding.mesh
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return sharding.OnMesh(jax.jit(train_step, donate_argnums=0,
                                 in_shardings=(state_shardings, batch_sharding),
                                 out_shardings=(state_shardings, replicated)), mesh,
                         activation_rules)


def make_eval_step(graphdef, *, params_shardings=None, batch_sharding=None, loss_chunk: int = 0,
                   activation_rules: dict | None = None):
  """`eval_step(params, batch) -> (summed NLL, summed weights)`, jitted (with the shardings, when
  given, as in shardings)."""

  def eval_step(params, batch):
    return model_nll(nnx.merge(graphdef, params), batch, loss_chunk=loss_chunk)

  if params_shardings is None:
    return jax.jit(eval_step)
  return sharding.OnMesh(jax.jit(eval_step, in_shardings=(params_shardings, batch_sharding)),
                         batch_sharding.mesh, activation_rules)
