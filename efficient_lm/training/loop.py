"""The training loop: `train_and_evaluate(run, workdir)`.

    start.setup            data, mesh, the train state (`train_state.build`), resume from the workdir
    train_steps            the step loop: progress, periodic evaluation and checkpoints, preemption
    evaluate.evaluate      loss, perplexity and bits per byte over a whole split
    report.report, sample  the final evaluation, the summary line and a text sample
    profile.Profiler       a trace of `train.profile_steps`
    compile_only           `main --compile_only`: the step compiled from shapes, nothing run

Knows nothing of any particular model (`train_step` scores the logits a model
returns against the shifted tokens). Everything a run writes goes to its
workdir: `metrics.jsonl`, `tensorboard/`, `config.json`, `tokenizer.model` and
`checkpoints/`.
"""

import logging
import time

import jax
import jax.numpy as jnp

from efficient_lm.config.run import RunConfig
from efficient_lm.parallel import distributed
from efficient_lm.runtime import figures as figures_lib
from efficient_lm.runtime import progress as progress_lib
from efficient_lm.runtime import signals
from efficient_lm.state import train_state
from efficient_lm.state import workdir as workdir_lib
from efficient_lm.training import compile_only as compile_only_lib
from efficient_lm.training import evaluate as evaluate_lib
from efficient_lm.training import flops as flops_lib
from efficient_lm.training import metrics as metrics_lib
from efficient_lm.training import prepare as config_check
from efficient_lm.training import profile as profile_lib
from efficient_lm.training import report as report_lib
from efficient_lm.training import start
from efficient_lm.training import step as train_step_lib
from efficient_lm.training import wandb as wandb_writer
from efficient_lm.training.start import Run

log = logging.getLogger(__name__)
PROGRESS_SECONDS = 30.0  # a progress line at least this often, besides every train.log_every steps

class NonFiniteError(FloatingPointError):
  """A step produced a non-finite loss or gradient norm."""


@jax.jit
def _track_first_bad(first_bad_step, step_metrics, step):
  finite = jnp.isfinite(step_metrics["loss"]) & jnp.isfinite(step_metrics["grad_norm"])
  return jnp.where((first_bad_step < 0) & ~finite, step, first_bad_step)


def train_steps(run: Run, agreement: distributed.StopAgreement) -> tuple[dict[str, float], dict | None]:
  """Trains from the restored step to `train.num_steps`: (the last evaluation's metrics, or {}; a
  preemption summary if a stop signal ended the loop early, else None).

  Run inside `signals.deferred`: a stop signal is polled after every step and before every
  evaluation batch (`agreement`: every process stops at the same one); the loop then saves the
  step it reached, waits until that checkpoint is committed and returns.
  """
  t = run.config.train
  built = run.built
  train_step = run.train_step
  eval_step = evaluate_lib.make_sharded_eval_step(run.config, built)
  start_step = int(run.state.step)
  progress = metrics_lib.Progress(start_step, t.num_steps,
                                  run.config.data.batch_size * run.config.data.seq_len,
                                  **utilisation(run))
  eval_metrics: dict[str, float] = {}
  # The first step whose loss or gradient norm was not finite, tracked on device so that
  # no step waits for the host; checked before anything is logged or saved.
  first_bad_step = jnp.array(-1, jnp.int32)

  def check_finite() -> None:
    bad = int(first_bad_step)
    if bad >= 0:
      raise NonFiniteError(
          f"non-finite loss or gradient norm at step {bad}; stopped without saving it: the last "
          f"good checkpoint is step {run.ckpt.latest_step()}. Lower train.learning_rate, raise "
          "train.warmup_steps or lower train.grad_clip, then rerun to resume from it")

  def save(step: int, eval_pending: bool = False) -> None:
    check_finite()
    run.ckpt.save(step, run.state, run.train_iter.get_state(),
                  {**run.meta, "learning_rate": float(built.schedule(step)),
                   "eval_pending": eval_pending})

  def should_stop() -> bool:
    return agreement.poll(signals.requested()) is not None

  def evaluate_at(done: int) -> dict[str, float] | None:
    check_finite()
    if run.eval_void:  # a split with no text: left out (said at setup); report() gives the reason
      return {}
    final = done == t.num_steps  # the final evaluation scores the whole split
    with progress_lib.phase(f"evaluating at step {done}"):
      figures = evaluate_lib.evaluate(eval_step, run.state.params, run.corpus, t.eval_split,
                         run.config.data.batch_size, run.mesh, run.layout,
                         max_tokens=0 if final else t.eval_tokens, rows=run.rows,
                         should_stop=should_stop)
    if figures is not None:
      run.writer.write(done, figures)
      log.info("eval at step %d: loss %.4f  perplexity %.2f  bits/byte %s", done,
               figures["eval_loss"], figures["eval_perplexity"],
               figures_lib.shown(figures["eval_bits_per_byte"]))
    return figures

  def stop(done: int, during_eval: bool = False) -> dict:
    if done not in run.ckpt.all_steps():  # (resumed at `done` and stopped again: it is saved)
      save(done, eval_pending=during_eval)
    with signals.phase(f"committing checkpoint {done}"):
      run.ckpt.wait()  # the save in flight is committed before the process goes
    return report_lib.preempted_summary(run, done, agreement.signal, during_eval)

  profiler = profile_lib.Profiler(run.config, run.workdir)
  last_line = time.monotonic()
  previous_metrics = None
  try:
    if run.eval_pending:  # a stop cut this step's evaluation short: it runs first
      eval_metrics = evaluate_at(start_step)
      if eval_metrics is None:
        return {}, stop(start_step, during_eval=True)
    for step in range(start_step, t.num_steps):
      profiler.before(step)
      batch = evaluate_lib.place_batch(next(run.train_iter), run.mesh, run.layout,
                          None if run.rows is None else (*run.rows, run.config.data.batch_size))
      run.state, step_metrics = train_step(run.state, batch)
      done = step + 1
      first_bad_step = _track_first_bad(first_bad_step, step_metrics, done)
      profiler.after(done, step_metrics)
      if step == start_step:  # the first step includes compilation: keep it out of the rate
        jax.block_until_ready(step_metrics)
        progress.reset_clock(done)
      # The host stays at most one step ahead of the devices (the next batch is placed while this
      # step runs): a stop then saves within a step, and a progress line is at most a step late.
      jax.block_until_ready(previous_metrics)
      previous_metrics = step_metrics
      if should_stop():
        return eval_metrics, stop(done)
      logged = done % t.log_every == 0 or done == t.num_steps
      if logged or time.monotonic() - last_line >= PROGRESS_SECONDS:
        check_finite()
        step_metrics = jax.device_get(step_metrics)
        rate = progress.tokens_per_sec(done)
        if logged:
          mfu = progress.mfu(rate)
          run.writer.write(done, {**step_metrics, "tokens_per_sec": rate,
                                  **({} if mfu is None else {"mfu": mfu})})
        log.info(progress.line(done, float(step_metrics["loss"]), rate))
        last_line = time.monotonic()
      if done % t.eval_every == 0 or done == t.num_steps:
        figures = evaluate_at(done)
        if figures is None:
          return eval_metrics, stop(done, during_eval=True)
        eval_metrics = figures
        last_line = time.monotonic()
      if done % t.checkpoint_every == 0 or done == t.num_steps:
        save(done)
      if done % t.eval_every == 0 or done % t.checkpoint_every == 0:
        progress.reset_clock(done)  # evaluation and checkpoint time stay out of tokens/s
  finally:
    profiler.stop()
  return eval_metrics, None


def utilisation(run: Run) -> dict:
  """What the progress line needs for MFU: the step's model FLOPs (`efficient_lm.training.flops`) and the
  job's devices' peak rate; nothing on a CPU (no meaningful peak), no FLOPs for a model they are
  not counted for (the line then gives tokens/s per device alone)."""
  device = run.mesh.devices.flat[0]
  peak = flops_lib.peak_flops(device.device_kind) if device.platform != "cpu" else None
  if peak is None:
    return {}
  return {"step_flops": flops_lib.step_flops(run.config, run.built.num_params),
          "peak_flops": peak * run.mesh.size, "num_devices": run.mesh.size}


def train_and_evaluate(run: RunConfig, workdir: str,
                       built: train_state.Built | None = None) -> dict[str, float]:
  """Trains `run` in `workdir` (resuming from its latest checkpoint) and returns the final eval.
  `run`, `built`: what `config_check.prepare` returned at the edge (without `built`, prepared
  here).

  A stop signal (SIGINT, SIGTERM: `signals`) during the steps or an evaluation ends the run with
  a committed checkpoint at the step reached and returns a preemption summary (`preempted`, the
  signal; `preempted_line`); during the final sample (the checkpoint committed) it raises
  `signals.Interrupted`. From Python its progress shows without any set-up (`progress.show`)."""
  progress_lib.show()
  if built is None:
    run, built = config_check.prepare(run)
  wandb_writer.check(run.train)  # the extra, before anything compiles
  compile_only_lib.use_compilation_cache(run)
  run = start.setup(run, workdir, built)
  try:
    began = time.perf_counter()
    agreement = distributed.StopAgreement()
    with signals.deferred("saving a checkpoint at the step reached"):
      with signals.phase("training"):
        eval_metrics, preempted = train_steps(run, agreement)
      if preempted is not None:
        return preempted
      summary = report_lib.report(run, eval_metrics, time.perf_counter() - began, agreement)
      if summary.get("preempted"):
        return summary
      with signals.phase("committing the final checkpoint"):
        run.ckpt.wait()
      if agreement.settle(signals.requested()):  # a signal since the last poll: no sample
        return report_lib.preempted_summary(run, int(run.state.step), agreement.signal)
    text = report_lib.sample(run)  # (a signal now stops it at once: the final checkpoint is committed)
    if text is not None:
      summary["sample"] = text
    return summary
  finally:
    run.writer.close()
    run.ckpt.close()
