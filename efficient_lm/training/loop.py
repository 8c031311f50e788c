"""The training loop: `train_and_evaluate(run, workdir)`.

    setup         data, mesh, the train state (`train_state.build`), resume from the workdir
    train_steps   the step loop: progress, periodic evaluation and checkpoints, preemption
    evaluate      loss, perplexity and bits per byte over a whole split
    report        the final evaluation, the summary line and a text sample

Knows nothing of any particular model (`train_step` scores the logits a model
returns against the shifted tokens). Everything a run writes goes to its
workdir: `metrics.jsonl`, `tensorboard/`, `config.json`, `tokenizer.model` and
`checkpoints/`.
"""

import dataclasses
import json
import logging
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from efficient_lm import data
from efficient_lm.config.run import RunConfig
from efficient_lm.inference import generation
from efficient_lm.ops import ring
from efficient_lm.parallel import distributed
from efficient_lm.parallel import sharding
from efficient_lm.parallel import targets
from efficient_lm.runtime import figures as figures_lib
from efficient_lm.runtime import output
from efficient_lm.runtime import progress as progress_lib
from efficient_lm.runtime import signals
from efficient_lm.state import checkpoint
from efficient_lm.state import train_state
from efficient_lm.state import workdir as workdir_lib
from efficient_lm.training import flops as flops_lib
from efficient_lm.training import metrics as metrics_lib
from efficient_lm.training import prepare as config_check
from efficient_lm.training import step as train_step_lib
from efficient_lm.training import step_memory
from efficient_lm.training import wandb as wandb_writer

log = logging.getLogger(__name__)
PROGRESS_SECONDS = 30.0  # a progress line at least this often, besides every train.log_every steps

# Kept importable from here: tests and experiments use them.
TrainState = train_state.TrainState
weighted_nll = train_step_lib.weighted_nll
make_train_step = train_step_lib.make_train_step
make_eval_step = train_step_lib.make_eval_step


WorkdirMismatchError = workdir_lib.WorkdirMismatchError


class NonFiniteError(FloatingPointError):
  """A step produced a non-finite loss or gradient norm."""


@jax.jit
def _track_first_bad(first_bad_step, step_metrics, step):
  finite = jnp.isfinite(step_metrics["loss"]) & jnp.isfinite(step_metrics["grad_norm"])
  return jnp.where((first_bad_step < 0) & ~finite, step, first_bad_step)


def place_batch(batch: dict, mesh: jax.sharding.Mesh, layout: str = "natural",
                rows: tuple[int, int, int] | None = None) -> dict:
  """A host batch on the mesh, in the model's sequence layout (`ops.ring`: 'zigzag' adds the
  positions RoPE needs; the loss, a sum over positions, is unchanged by the permutation); with
  `rows` (first, last, global size) the batch holds only this process's rows."""
  return sharding.shard_batch(ring.permute_batch(batch, mesh.shape["context"], layout), mesh, rows)


def evaluate(eval_step, params, corpus, split: str, batch_size: int, mesh,
             layout: str = "natural", max_tokens: int = 0,
             rows: tuple[int, int] | None = None,
             should_stop: Callable[[], bool] | None = None) -> dict[str, float] | None:
  """Loss (nats/token), perplexity and bits per byte over the whole split, every token once (or
  its first windows holding at least `max_tokens` targets: `train.eval_tokens`).

  A model that scores only the last positions of each window (Perceiver-AR)
  is charged the bytes of the tokens it scored: the split's bytes times the
  fraction of target tokens scored (an estimate; exact when all are scored).
  A long evaluation says how far it is about every 30 s. `should_stop()` is asked before every
  batch (by every process alike); when it says so the evaluation stops and returns None. A split
  with no text is not scored (its figures null, with the reason); bits per byte is null where the
  tokenizer does not give the split's text back (`data.bits_per_byte_withheld`).
  """
  empty = data.without_text(corpus, split)
  if empty:
    return metrics_lib.not_evaluated(f"not evaluated: the {split} split {empty}")
  total_nll, scored, targets = 0.0, 0.0, 0.0
  truncated = False
  last_note = time.monotonic()
  share = {} if rows is None else dict(batch_size=rows[1] - rows[0],
                                       process_index=jax.process_index(),
                                       process_count=jax.process_count())
  global_batch = batch_size if rows is None else (rows[1] - rows[0]) * jax.process_count()
  for index, batch in enumerate(corpus.eval_batches(split, **({"batch_size": batch_size} | share))):
    if should_stop is not None and should_stop():
      return None
    placed = place_batch(batch, mesh, layout, None if rows is None else (*rows, batch_size))
    nll, weight = eval_step(params, placed)
    total_nll += float(nll)
    scored += float(weight)
    targets += (float(np.sum(batch["weights"])) if rows is None else
                _targets_in_batch(corpus, split, index, global_batch))
    if time.monotonic() - last_note > 30:
      last_note = time.monotonic()
      log.info("... evaluating on %s: %s tokens so far", split, f"{int(targets):,}")
    if max_tokens and targets >= max_tokens:
      truncated = True
      break
  share = targets / corpus.num_tokens(split) if truncated else 1.0  # of the split's bytes
  num_bytes = corpus.num_bytes(split) * share * (scored / targets if targets else 1.0)
  figures = metrics_lib.loss_figures(total_nll, scored, num_bytes,
                                     data.bits_per_byte_withheld(corpus, split))
  return {f"eval_{name}": value for name, value in figures.items()}


def _targets_in_batch(corpus, split: str, index: int, global_batch: int) -> float:
  """Target tokens in global evaluation batch `index` (the windows of every process's rows): the
  same count on every process, whatever rows each holds."""
  seq_len, last = corpus.seq_len, corpus.num_tokens(split)  # targets are positions 1..last
  starts = (index * global_batch + np.arange(global_batch, dtype=np.int64)) * seq_len
  return float(np.clip(last - starts, 0, seq_len).sum())


def make_sharded_eval_step(run: RunConfig, built: train_state.Built):
  """The eval step with the train state's parameter shardings and the batch's."""
  return train_step_lib.make_eval_step(built.graphdef, params_shardings=built.shardings.params,
                                       batch_sharding=sharding.batch_sharding(built.mesh),
                                       loss_chunk=run.train.loss_chunk,
                                       activation_rules=run.mesh.activation_axes)


def compile_only(run: RunConfig, target: str | None = None, num_slices: int = 1) -> dict:
  """`main --compile_only`: the run checked at the edge (`prepare`), the train step compiled from
  shapes (no data, no parameters), and what it needs per device; nothing is trained or written.
  With `target` (`targets.load`'s '<platform>:<device>:<topology>') the step is compiled for that
  accelerator's devices, from any host."""
  if not target:  # (a target's compile-only client cannot read cache entries back: no cache)
    use_compilation_cache(run)
  accelerator = None
  if target:
    with progress_lib.phase(f"loading the compiler for {target}"):
      accelerator = targets.load(target, num_slices)
  run, built = config_check.prepare(run, accelerator.devices if accelerator else None)
  what = f"compiling the train step for {target or targets.platform_of(built.mesh.devices.flat)}"
  log.info("%s (%s, seq_len %s, batch %s)...", what, run.model.name,
           f"{run.data.seq_len:,}", run.data.batch_size)
  with progress_lib.phase(what):
    compiled = step_memory.compile_train_step(run, built)
  return step_memory.report(compiled, run, built, accelerator)


@dataclasses.dataclass
class Run:
  """What the step loop works with; built by `setup`."""
  config: RunConfig  # as it trains: the vocabulary its tokenizer fixed (written to config.json)
  workdir: str
  corpus: Any
  mesh: jax.sharding.Mesh
  layout: str
  built: train_state.Built     # abstract: the shapes, shardings, optimizer and schedule
  state: train_state.TrainState
  train_step: Any               # the compiled step (checked to fit before anything ran)
  ckpt: checkpoint.Checkpointer
  train_iter: Any
  writer: Any
  meta: dict
  rows: tuple[int, int] | None = None  # this process's rows of every batch (per-host input)
  eval_pending: bool = False    # resumed from a stop during the evaluation at this step: redo it
  eval_void: str | None = None  # why train.eval_split is left out (no text), if it is


def setup(run: RunConfig, workdir: str, built: train_state.Built | None = None) -> Run:
  """Data, mesh and train state; the state and data position restored from the workdir if it has
  checkpoints. Every check runs before the workdir is touched (`workdir.Workdir`): a run of
  another model or corpus is refused with the workdir byte-identical, and whatever config.json,
  data.json and the checkpoints' metadata can answer is answered before any data is prepared or
  anything compiles. A resumed state is restored straight into its shardings (no random init
  beside it). `run`, `built`: what `config_check.prepare` returned at the edge (without `built`,
  prepared here); a vocabulary the tokenizer fixes later is a new RunConfig (`with_vocab`)."""
  if built is None:
    run, built = config_check.prepare(run)
  t, asked, mesh, abstract = run.train, run.data, built.mesh, built
  wd = workdir_lib.Workdir(workdir)
  _refuse_early(run, abstract, wd)
  # The data checks that read no more than the config names (a `text:` glob), on process 0.
  data_checks = distributed.primary_first(lambda: data.preflight(asked), "corpus checked",
                                          others=lambda: data.preflight(asked, read=False))
  # Compile the step first, from shapes only: a step that cannot fit stops here, before any data.
  compiled = _compiled_step(run, abstract)
  own = wd.resume_tokenizer(asked)  # resuming: the workdir's tokenizer, whatever the cache holds
  with progress_lib.phase("preparing the data"), output.library_prints_discarded():
    corpus = distributed.primary_first(lambda: data.load(asked, data_checks, own), "data prepared")
  _check_same_corpus(corpus)
  eval_void = data.check_splits(corpus, asked, t.eval_split, t.num_steps)  # (empty train: refused)
  vocab = _vocab_size(run, corpus.tokenizer, wd)
  if vocab < run.data.vocab_size:  # a small corpus: fewer pieces
    log.info("the tokenizer has %d pieces (data.vocab_size=%d): the model's vocabulary is %d",
             corpus.tokenizer.vocab_size, run.data.vocab_size, vocab)
    run = run.with_vocab(vocab)
    abstract = config_check.place(run, mesh)  # the model's checks on the mesh again
    compiled = _compiled_step(run, abstract)
  wd.check_data(corpus.identity, allow_new_data=t.allow_new_data)
  batch_size, seq_len = run.data.batch_size, run.data.seq_len
  rows = sharding.process_rows(mesh, batch_size, seq_len)
  if rows is None:  # every process reads the global batch and places its own slices
    train_iter = corpus.train_iterator(batch_size=batch_size, seed=t.seed)
  else:  # per-host input: this process reads only its rows of every global batch
    train_iter = corpus.train_iterator(batch_size=rows[1] - rows[0], seed=t.seed,
                                       process_index=jax.process_index(),
                                       process_count=jax.process_count())
    log.info("each process reads its own %d of the %d rows of every batch", rows[1] - rows[0],
             batch_size)
  open_checkpoints = lambda: checkpoint.Checkpointer(wd.checkpoints, max_to_keep=t.keep_checkpoints)
  ckpt, restored, meta, saved_meta = None, None, None, {}

  def check_meta(saved: dict) -> None:
    wd.check_model(saved, meta)
    saved_meta.update(saved)

  if wd.has_checkpoints():  # (a workdir without any is not touched before the checks pass)
    meta = workdir_lib.model_meta(run, abstract.state.params)
    ckpt = open_checkpoints()
    with progress_lib.phase("restoring the latest checkpoint"):
      restored = ckpt.restore_latest(abstract.state, check_meta)
  if restored is not None:
    latest, state, data_state = restored
    train_iter.set_state(data_state)
    log.info("resumed from %s at step %d", ckpt.directory, latest)
    _warn_if_rate_jumps(saved_meta.get("learning_rate"), float(abstract.schedule(latest)), latest)
  else:
    state = train_state.initialize(run, abstract)
  meta = meta or workdir_lib.model_meta(run, abstract.state.params)
  if distributed.is_primary():  # every check has passed: now the workdir is written
    # data.json's settings: the corpus-deciding fields as asked (before a small corpus's vocab)
    wd.write(run, corpus.tokenizer, corpus.identity, workdir_lib.corpus_settings(asked))
    if restored is not None:
      moved = metrics_lib.rewind(wd.path, restored[0])
      if moved:
        log.info("moved %d metrics.jsonl lines of steps after %d (the run that was cut short) to "
                 "%s", moved, restored[0], metrics_lib.SUPERSEDED)
  distributed.barrier("workdir written")
  ckpt = ckpt or open_checkpoints()
  distributed.PeerWatch.describe_checkpoints = lambda: checkpoint.describe_committed(ckpt.directory)
  log.info("model %s: %s parameters; %s train tokens; workdir %s", run.model.name,
           f"{abstract.num_params:,}", f"{corpus.num_tokens('train'):,}", wd.path)
  writer = metrics_lib.open_writers(run, wd.path, distributed.is_primary())
  return Run(config=run, workdir=wd.path, corpus=corpus, mesh=mesh,
             layout=abstract.layout, built=abstract, state=state,
             train_step=compiled, ckpt=ckpt, train_iter=train_iter, writer=writer, meta=meta,
             rows=rows, eval_pending=restored is not None and bool(saved_meta.get("eval_pending")),
             eval_void=eval_void)


def _refuse_early(run: RunConfig, abstract: train_state.Built, wd: workdir_lib.Workdir) -> None:
  """The workdir's refusals that config.json, data.json and the checkpoints' metadata can give
  at once (another corpus, tokenizer or model), before any data is prepared or anything compiles.
  The same checks run again, authoritatively, once the corpus is loaded and the state restored."""
  if not wd.has_checkpoints():
    return
  wd.check_settings(run.data, allow_new_data=run.train.allow_new_data)
  saved_meta = checkpoint.latest_meta(wd.checkpoints)
  if saved_meta is None:
    return
  vocab = wd.resumed_vocab_size(run.data.vocab_size)
  if vocab != run.data.vocab_size:  # the model as it will be built once the tokenizer is known
    run = run.with_vocab(vocab)
    abstract = train_state.build(run, abstract.mesh, abstract=True)
  wd.check_model(saved_meta, workdir_lib.model_meta(run, abstract.state.params))


def _check_same_corpus(corpus) -> None:
  """Every process trains on the same corpus and tokenizer: with a `data.data_dir` of each host's
  own, each prepared its own copy; one that differs stops the job before anything is written."""
  differ = distributed.processes_differing(json.dumps(corpus.identity, sort_keys=True))
  if differ:
    raise data.DataError(
        f"process(es) {', '.join(map(str, differ))} prepared another corpus or tokenizer than "
        f"process 0 (data.json identity {json.dumps(corpus.identity, sort_keys=True)} on process "
        f"{jax.process_index()}); with a data.data_dir of each host's own the hosts must see the "
        "same files: put data.data_dir on a filesystem every host sees, or copy process 0's "
        "prepared data.data_dir to the others")


def _vocab_size(run: RunConfig, tokenizer, wd: workdir_lib.Workdir) -> int:
  """The model's vocabulary: the tokenizer's size when it is below data.vocab_size (a small
  corpus), but never below the vocabulary of the checkpoints a run resumes (a fine-tuning run on
  new data, `train.allow_new_data`, keeps their shapes)."""
  vocab = min(run.data.vocab_size, tokenizer.vocab_size)
  saved = wd.saved_config() if wd.has_checkpoints() else None
  if saved is not None:
    vocab = max(vocab, min(run.data.vocab_size, saved.data.vocab_size))
  return vocab


def _compiled_step(run: RunConfig, abstract: train_state.Built):
  """The train step compiled for `abstract` (the train state's shapes), checked to fit a device."""
  what = f"compiling the train step for {targets.platform_of(abstract.mesh.devices.flat)}"
  log.info("%s (%s, seq_len %s, batch %s)...", what, run.model.name,
           f"{run.data.seq_len:,}", run.data.batch_size)
  with progress_lib.phase(what):
    compiled = step_memory.compile_train_step(run, abstract)
  memory = step_memory.report(compiled, run, abstract)
  log.info("%s", step_memory.describe(memory))
  step_memory.check_fits(memory)
  log.info("%s", abstract.describe())
  return compiled


def _warn_if_rate_jumps(saved_rate: float | None, new_rate: float, step: int) -> None:
  """One warning line when the resumed schedule's rate at `step` is >10% off the saved run's."""
  if saved_rate is None:
    return
  if abs(new_rate - saved_rate) > 0.1 * max(abs(saved_rate), 1e-12):
    log.warning("the learning rate jumps on resume at step %d: %.3g in the checkpoint's run, %.3g "
                "now (train.num_steps or the schedule changed; train.schedule='wsd' keeps the rate "
                "when a run is extended in its stable phase)", step, saved_rate, new_rate)


class _Profiler:
  """`train.profile_steps` ('START:END'): a trace of those steps on process 0, started at START
  (or at the first step of a run resumed inside the range) and stopped at END, or when the loop
  ends first (a range past num_steps, a stop signal, an error)."""

  def __init__(self, run: RunConfig, workdir: str):
    self.range = profile_range(run)
    self.folder = os.path.join(workdir, "profile")
    self.on = False

  def before(self, step: int) -> None:
    if self.range and not self.on and self.range[0] <= step + 1 <= self.range[1] and (
        distributed.is_primary()):
      jax.profiler.start_trace(self.folder)
      self.on = True
      log.info("profiling steps %d to %d into %s", step + 1, self.range[1], self.folder)

  def after(self, done: int, step_metrics) -> None:
    if self.on and done >= self.range[1]:
      self.stop(step_metrics)

  def stop(self, step_metrics=None) -> None:
    if self.on:
      if step_metrics is not None:
        jax.block_until_ready(step_metrics)
      jax.profiler.stop_trace()
      self.on = False


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
  eval_step = make_sharded_eval_step(run.config, built)
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
      figures = evaluate(eval_step, run.state.params, run.corpus, t.eval_split,
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
    return preempted_summary(run, done, agreement.signal, during_eval)

  profiler = _Profiler(run.config, run.workdir)
  last_line = time.monotonic()
  previous_metrics = None
  try:
    if run.eval_pending:  # a stop cut this step's evaluation short: it runs first
      eval_metrics = evaluate_at(start_step)
      if eval_metrics is None:
        return {}, stop(start_step, during_eval=True)
    for step in range(start_step, t.num_steps):
      profiler.before(step)
      batch = place_batch(next(run.train_iter), run.mesh, run.layout,
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
  job's devices' peak rate; nothing on a CPU (no meaningful peak)."""
  device = run.mesh.devices.flat[0]
  peak = flops_lib.peak_flops(device.device_kind) if device.platform != "cpu" else None
  if peak is None:
    return {}
  patterns = list(run.config.model.patterns())
  return {"step_flops": flops_lib.step_flops(run.config, run.built.num_params, patterns),
          "peak_flops": peak * run.mesh.size, "num_devices": run.mesh.size}


def preempted_summary(run: Run, step: int, signal_name: str, during_eval: bool = False) -> dict:
  """What a loop stopped by a signal returns; `preempted_line` is the line the command ends with."""
  where = "" if signals.requested() == signal_name else " (on another process of the job)"
  line = (f"stopped by {signal_name}{where} at step {step}: checkpoint {step} is committed in "
          f"{run.ckpt.directory}{'; its evaluation runs first on resume' if during_eval else ''}; "
          "rerun the same command to resume")
  return {"step": step, "preempted": signal_name, "preempted_line": line}


def report(run: Run, eval_metrics: dict[str, float], seconds: float,
           agreement: distributed.StopAgreement) -> dict:
  """The summary of a finished run (evaluating a restored one that had nothing left to train),
  logged; a preemption summary if a stop signal cut that evaluation short."""
  t = run.config.train
  if not eval_metrics:
    eval_step = make_sharded_eval_step(run.config, run.built)
    step = int(run.state.step)
    with progress_lib.phase(f"evaluating at step {step}"):
      eval_metrics = evaluate(eval_step, run.state.params, run.corpus, t.eval_split,
                              run.config.data.batch_size, run.mesh, run.layout, rows=run.rows,
                              should_stop=lambda: agreement.poll(signals.requested()) is not None)
    if eval_metrics is None:  # the checkpoint at this step exists: it was restored
      return preempted_summary(run, step, agreement.signal)
  summary = {"step": int(run.state.step), **eval_metrics, "train_seconds": seconds}
  log.info("done: step %d in %.0f s; %s loss %s, bits/byte %s", summary["step"], seconds,
           t.eval_split, figures_lib.shown(eval_metrics["eval_loss"]),
           figures_lib.shown(eval_metrics["eval_bits_per_byte"]))
  return summary


def sample(run: Run) -> str | None:
  """The end-of-run text sample from the final parameters (None: no sample), logged."""
  t = run.config.train
  if not (t.sample_prompt and t.sample_tokens):
    return None
  with progress_lib.phase("sampling"):
    try:
      text = generation.sample_from_state(run.config, run.state.params, run.corpus.tokenizer,
                                          t.sample_prompt, num_tokens=t.sample_tokens, seed=t.seed)
    except ValueError as e:  # a prompt the tokenizer cannot encode (a generated task's)
      log.info("no sample: %s", str(e).splitlines()[0])
      return None
  if text is None:
    log.info("no sample: the prompt fills the model's learned positions (model.seq_len)")
  else:
    log.info("sample:\n%s", text)
  return text


def use_compilation_cache(run: RunConfig) -> None:
  """jax's persistent compilation cache in `train.compilation_cache_dir` ('' = off)."""
  folder = run.train.compilation_cache_dir
  if folder:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)


def profile_range(run: RunConfig) -> tuple[int, int] | None:
  """(first, last) step of `train.profile_steps` ('START:END'), or None."""
  spec = run.train.profile_steps
  if not spec:
    return None
  first, _, last = str(spec).partition(":")
  return int(first), int(last or first)


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
  use_compilation_cache(run)
  run = setup(run, workdir, built)
  try:
    start = time.perf_counter()
    agreement = distributed.StopAgreement()
    with signals.deferred("saving a checkpoint at the step reached"):
      with signals.phase("training"):
        eval_metrics, preempted = train_steps(run, agreement)
      if preempted is not None:
        return preempted
      summary = report(run, eval_metrics, time.perf_counter() - start, agreement)
      if summary.get("preempted"):
        return summary
      with signals.phase("committing the final checkpoint"):
        run.ckpt.wait()
      if agreement.settle(signals.requested()):  # a signal since the last poll: no sample
        return preempted_summary(run, int(run.state.step), agreement.signal)
    text = sample(run)  # (a signal now stops it at once: the final checkpoint is committed)
    if text is not None:
      summary["sample"] = text
    return summary
  finally:
    run.writer.close()
    run.ckpt.close()
