"""The end of a run: its summary (`report`, evaluating a restored run that had nothing left to
train), the summary of a run a stop signal ended (`preempted_summary`), and the text sample from
the final parameters (`sample`).
"""

import logging

from efficient_lm.inference import generation
from efficient_lm.parallel import distributed
from efficient_lm.runtime import figures as figures_lib
from efficient_lm.runtime import progress as progress_lib
from efficient_lm.runtime import signals
from efficient_lm.training import evaluate as evaluate_lib
from efficient_lm.training.start import Run

log = logging.getLogger(__name__)


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
    eval_step = evaluate_lib.make_sharded_eval_step(run.config, run.built)
    step = int(run.state.step)
    with progress_lib.phase(f"evaluating at step {step}"):
      eval_metrics = evaluate_lib.evaluate(eval_step, run.state.params, run.corpus, t.eval_split,
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
