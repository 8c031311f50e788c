"""`main --compile_only`: the train step compiled from shapes for the configured mesh (or an
accelerator's, from any host) and what it needs per device, nothing trained or written; and jax's
persistent compilation cache, which a training run uses too.
"""

import logging
import os

import jax

from efficient_lm.config.run import RunConfig
from efficient_lm.parallel import targets
from efficient_lm.runtime import progress as progress_lib
from efficient_lm.training import prepare as config_check
from efficient_lm.training import step_memory

log = logging.getLogger(__name__)


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


def use_compilation_cache(run: RunConfig) -> None:
  """jax's persistent compilation cache in `train.compilation_cache_dir` ('' = off)."""
  folder = run.train.compilation_cache_dir
  if folder:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
