"""The optimizer: AdamW with a learning-rate schedule, gradient clipping and masked weight decay.

    tx, schedule = optimizer.make_optimizer(config.train)

Which parameters decay is decided here, once, by parameter name: the matrices
(`kernel` of every linear map, `embedding` of the token and position tables)
decay; everything else (norm `scale`s, `bias`es, and the Perceiver-AR
compression map, which starts as mean pooling and would shrink the history
towards zero) does not. The name is the last key of the parameter's path in the
NNX state (the path ends in the Variable's `.value`, which is skipped).

Schedules (`train.schedule`), both with a linear warmup over `train.warmup_steps`
from 0 to `train.learning_rate`:
- `cosine`: cosine decay to 10% of the peak at `train.num_steps`. The rate at a
  step depends on `num_steps`, so raising `num_steps` on resume changes it.
- `wsd` (warmup, stable, decay): constant at the peak, then a linear decay to 10%
  of the peak over the last `train.decay_fraction` of the steps. Raising
  `num_steps` during the stable phase leaves every rate so far unchanged.
"""

import jax
import jax.numpy as jnp
import optax

from efficient_lm.config.train import TrainConfig

SCHEDULES = ("cosine", "wsd")
DECAYED_NAMES = ("kernel", "embedding")
END_FRACTION = 0.1  # both schedules end at this fraction of the peak


def parameter_name(path: tuple) -> str:
  """The parameter's own name: the last dict key of its path (`.value` and list indices skipped)."""
  for entry in reversed(path):
    key = getattr(entry, "key", None)
    if isinstance(key, str):
      return key
  return ""


def decay_mask(params):
  """True for the parameters weight decay applies to (see the module docstring)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: parameter_name(path) in DECAYED_NAMES, params)


def learning_rate_schedule(t: TrainConfig) -> optax.Schedule:
  """The rate for each step: `train.schedule` over `train.num_steps` steps."""
  peak, warmup, total = t.learning_rate, t.warmup_steps, max(t.num_steps, t.warmup_steps + 1)
  end = END_FRACTION * peak
  name = t.schedule
  if name == "cosine":
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup, decay_steps=total, end_value=end)
  if name == "wsd":
    decay_steps = max(1, round(t.decay_fraction * total))
    decay_start = max(warmup, total - decay_steps)

    def wsd(step):
      step = jnp.asarray(step, jnp.float32)
      warm = peak * step / max(warmup, 1)
      frac = jnp.clip((step - decay_start) / max(total - decay_start, 1), 0.0, 1.0)
      stable_or_decay = peak + (end - peak) * frac
      return jnp.where(step < warmup, warm, stable_or_decay)
    return wsd
  raise ValueError(f"train.schedule={name!r} is not one of {SCHEDULES}")


def make_optimizer(t: TrainConfig
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW (b1 0.9, b2 0.95) on `train.schedule`, global-norm clipping, decay on the matrices only."""
  schedule = learning_rate_schedule(t)
  adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=t.weight_decay, mask=decay_mask)
  clip = optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()
  return optax.chain(clip, adamw), schedule
