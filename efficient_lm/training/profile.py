"""`train.profile_steps`: a jax profiler trace of a range of the loop's steps (`Profiler`)."""

import logging
import os

import jax

from efficient_lm.config.run import RunConfig
from efficient_lm.parallel import distributed

log = logging.getLogger(__name__)


class Profiler:
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


def profile_range(run: RunConfig) -> tuple[int, int] | None:
  """(first, last) step of `train.profile_steps` ('START:END'), or None."""
  spec = run.train.profile_steps
  if not spec:
    return None
  first, _, last = str(spec).partition(":")
  return int(first), int(last or first)
