"""The training loop: AdamW (warmup + cosine), jitted train step, eval, checkpoints, resume.

Knows nothing of any particular model: it builds `models.create(config.model)`
and trains the logits it returns against the shifted tokens. Randomness is a
function of `train.seed` and the step only (dropout key = fold_in(seed, step)),
so a resumed run sees exactly what an uninterrupted one would.
"""

import json
import logging
import math
import os
import shutil
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from flax import struct

from efficient_lm import checkpoint
from efficient_lm import config_check
from efficient_lm import data
from efficient_lm import distributed
from efficient_lm import metrics as metrics_lib
from efficient_lm import models
from efficient_lm import preemption
from efficient_lm import sample
from efficient_lm import sharding
from efficient_lm.ops import ring

log = logging.getLogger(__name__)


@struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


class WorkdirMismatchError(RuntimeError):
  """The workdir holds checkpoints of a different model than the config describes."""


class NonFiniteError(FloatingPointError):
  """A step produced a non-finite loss or gradient norm."""


@jax.jit
def _track_first_bad(first_bad_step, step_metrics, step):
  finite = jnp.isfinite(step_metrics["loss"]) & jnp.isfinite(step_metrics["grad_norm"])
  return jnp.where((first_bad_step < 0) & ~finite, step, first_bad_step)


def make_optimizer(t: ml_collections.ConfigDict) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with linear warmup and cosine decay to 10% of the peak; clipping; no decay on norms/biases."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=t.learning_rate, warmup_steps=t.warmup_steps,
      decay_steps=max(t.num_steps, t.warmup_steps + 1), end_value=0.1 * t.learning_rate)

  def decay_mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: str(getattr(path[-1], "key", path[-1])) in ("kernel", "embedding"), params)

  adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=t.weight_decay, mask=decay_mask)
  clip = optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()
  return optax.chain(clip, adamw), schedule


def weighted_nll(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
  """(summed NLL in nats, summed weights) over the positions the logits cover (the last T')."""
  T = logits_BTV.shape[1]
  targets_BT, weights_BT = targets_BT[:, -T:], weights_BT[:, -T:]
  nll_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
  return jnp.sum(nll_BT * weights_BT), jnp.sum(weights_BT)


def make_train_step(graphdef, tx, schedule, seed: int):
  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    dropout_key = jax.random.fold_in(jax.random.key(seed), state.step)

    def loss_fn(params):
      logits = nnx.merge(graphdef, params)(batch["inputs"], positions_BT=batch.get("positions"),
                                           dropout_key=dropout_key)
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
  @jax.jit
  def eval_step(params, batch):
    logits = nnx.merge(graphdef, params)(batch["inputs"], positions_BT=batch.get("positions"))
    return weighted_nll(logits, batch["targets"], batch["weights"])
  return eval_step


def place_batch(batch: dict, mesh: jax.sharding.Mesh, layout: str = "natural") -> dict:
  """A host batch on the mesh, in the model's sequence layout (`ops.ring`: 'zigzag' adds the
  positions RoPE needs; the loss, a sum over positions, is unchanged by the permutation)."""
  return sharding.shard_batch(ring.permute_batch(batch, mesh.shape["context"], layout), mesh)


def evaluate(eval_step, params, corpus, split: str, batch_size: int, mesh,
             layout: str = "natural") -> dict[str, float]:
  """Loss (nats/token), perplexity and bits per byte over the whole split, every token once.

  A model that scores only the last positions of each window (Perceiver-AR)
  is charged the bytes of the tokens it scored: the split's bytes times the
  fraction of target tokens scored (an estimate; exact when all are scored).
  """
  total_nll, scored, targets = 0.0, 0.0, 0.0
  for batch in corpus.eval_batches(split, batch_size=batch_size):
    nll, weight = eval_step(params, place_batch(batch, mesh, layout))
    total_nll += float(nll)
    scored += float(weight)
    targets += float(np.sum(batch["weights"]))
  loss = total_nll / max(scored, 1.0)
  num_bytes = corpus.num_bytes(split) * (scored / targets if targets else 1.0)
  return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 80.0)),
          "eval_bits_per_byte": metrics_lib.bits_per_byte(total_nll, num_bytes)}


def model_meta(config: ml_collections.ConfigDict, params) -> dict:
  """What a checkpoint's model is: its name and every parameter's shape."""
  shapes = {jax.tree_util.keystr(path): list(np.shape(x))
            for path, x in jax.tree_util.tree_leaves_with_path(params)}
  return {"model_name": config.model.name, "param_shapes": shapes}


def _check_same_model(saved: dict, current: dict, workdir: str) -> None:
  if saved == current:
    return
  if saved.get("model_name") != current["model_name"]:
    what = f"model.name={saved.get('model_name')!r}, the config has {current['model_name']!r}"
  else:
    diff = sorted(k for k in set(saved["param_shapes"]) | set(current["param_shapes"])
                  if saved["param_shapes"].get(k) != current["param_shapes"].get(k))
    what = (f"parameter shapes differ at {diff[0]}: saved {saved['param_shapes'].get(diff[0])}, "
            f"config gives {current['param_shapes'].get(diff[0])}")
  raise WorkdirMismatchError(
      f"workdir {workdir} holds checkpoints of another model ({what}); use a new --workdir, "
      "or the config the workdir was trained with (its config.json)")


def _write_workdir_files(config, workdir: str, tokenizer) -> None:
  with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
    f.write(config.to_json_best_effort(indent=2))
  target = os.path.join(workdir, "tokenizer.model")
  if os.path.abspath(tokenizer.model_path) != os.path.abspath(target):
    shutil.copyfile(tokenizer.model_path, target)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and returns the final eval."""
  config_check.validate(config)
  workdir = os.path.abspath(os.path.expanduser(workdir))
  os.makedirs(workdir, exist_ok=True)
  t = config.train

  corpus = distributed.primary_first(lambda: data.load(config.data), "data prepared")
  if distributed.is_primary():
    _write_workdir_files(config, workdir, corpus.tokenizer)
  mesh = sharding.make_mesh(config.mesh)
  model = models.create(config.model, rngs=nnx.Rngs(t.seed), mesh=mesh)
  layout = models.sequence_layout(config.model, mesh)
  graphdef, params = nnx.split(model)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  tx, schedule = make_optimizer(t)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  state = jax.device_put(state, sharding.replicated(mesh))
  meta = model_meta(config, params)

  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=t.keep_checkpoints)
  train_iter = corpus.train_iterator(batch_size=config.data.batch_size, seed=t.seed)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  restored = ckpt.restore_latest(abstract, lambda saved: _check_same_model(saved, meta, workdir))
  if restored is not None:
    latest, state, data_state = restored
    train_iter.set_state(data_state)
    log.info("resumed from %s at step %d", ckpt.directory, latest)
  start_step = int(state.step)

  log.info("model %s: %s parameters; %s train tokens; workdir %s", config.model.name,
           f"{num_params:,}", f"{corpus.num_tokens('train'):,}", workdir)
  writer = metrics_lib.MetricWriter(workdir) if distributed.is_primary() else metrics_lib.NullWriter()
  train_step = make_train_step(graphdef, tx, schedule, t.seed)
  eval_step = make_eval_step(graphdef)
  tokens_per_step = config.data.batch_size * config.data.seq_len
  progress = metrics_lib.Progress(start_step, t.num_steps, tokens_per_step)
  eval_metrics: dict[str, float] = {}
  start_time = time.perf_counter()

  # The first step whose loss or gradient norm was not finite, tracked on device so that
  # no step waits for the host; checked before anything is logged or saved.
  first_bad_step = jnp.array(-1, jnp.int32)

  def check_finite() -> None:
    bad = int(first_bad_step)
    if bad >= 0:
      raise NonFiniteError(
          f"non-finite loss or gradient norm at step {bad}; stopped without saving it: the last "
          f"good checkpoint is step {ckpt.latest_step()}. Lower train.learning_rate, raise "
          "train.warmup_steps or lower train.grad_clip, then rerun to resume from it")

  def save(step: int) -> None:
    check_finite()
    ckpt.save(step, state, train_iter.get_state(), meta)

  stop = preemption.StopRequest()
  with stop:
    for step in range(start_step, t.num_steps):
      batch = place_batch(next(train_iter), mesh, layout)
      state, step_metrics = train_step(state, batch)
      done = step + 1
      first_bad_step = _track_first_bad(first_bad_step, step_metrics, done)
      if step == start_step:  # the first step includes compilation: keep it out of the rate
        jax.block_until_ready(step_metrics)
        progress.reset_clock(done)
      # Several processes agree at log steps (a signal may reach them at different steps): all save one.
      if (stop.requested if jax.process_count() == 1 else
          done % t.log_every == 0 and distributed.any_process(stop.requested)):
        save(done)
        signal_name = stop.signal_name or "a stop signal on another process"
        log.warning("received %s at step %d: saved checkpoint %d in %s; rerun the same command "
                    "to resume", signal_name, done, done, ckpt.directory)
        writer.close()
        ckpt.close()
        return {"step": done, "preempted": signal_name}
      if done % t.log_every == 0 or done == t.num_steps:
        check_finite()
        step_metrics = jax.device_get(step_metrics)
        rate = progress.tokens_per_sec(done)
        writer.write(done, {**step_metrics, "tokens_per_sec": rate})
        log.info(progress.line(done, float(step_metrics["loss"]), rate))
      if done % t.eval_every == 0 or done == t.num_steps:
        check_finite()
        eval_metrics = evaluate(eval_step, state.params, corpus, t.eval_split,
                                config.data.batch_size, mesh, layout)
        writer.write(done, eval_metrics)
        log.info("eval at step %d: loss %.4f  perplexity %.2f  bits/byte %.4f", done,
                 eval_metrics["eval_loss"], eval_metrics["eval_perplexity"],
                 eval_metrics["eval_bits_per_byte"])
      if done % t.checkpoint_every == 0 or done == t.num_steps:
        save(done)
      if done % t.eval_every == 0 or done % t.checkpoint_every == 0:
        progress.reset_clock(done)  # evaluation and checkpoint time stay out of tokens/s

  if not eval_metrics:  # nothing left to train: report the restored model
    eval_metrics = evaluate(eval_step, state.params, corpus, t.eval_split,
                            config.data.batch_size, mesh, layout)
  elapsed = time.perf_counter() - start_time
  summary = {"step": int(state.step), **eval_metrics, "train_seconds": elapsed}
  log.info("done: step %d in %.0f s; %s loss %.4f, bits/byte %.4f", summary["step"], elapsed,
           t.eval_split, eval_metrics["eval_loss"], eval_metrics["eval_bits_per_byte"])
  if t.sample_prompt and t.sample_tokens:
    sample_graphdef = graphdef  # one window on one device: the single-device ops
    if mesh.shape["context"] > 1:
      sample_graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.create(config.model,
                                                                          rngs=nnx.Rngs(0))))
    text = sample.generate_text(nnx.merge(sample_graphdef, state.params), corpus.tokenizer,
                                t.sample_prompt, num_tokens=t.sample_tokens, seed=t.seed)
    log.info("sample:\n%s", text)
    summary["sample"] = text
  writer.close()
  ckpt.close()
  return summary
