"""The train command once its flags and the checks that need no jax have passed
(`train_command`): jax started (one process of a job, or several), then `--compile_only`'s
report, or the run trained and its summary the one JSON line of stdout. Every error that is the
user's to fix is one `error: ...` line: exit status 2, or 3 for a step that does not fit.

Imported by `train_command` only after those checks: everything here loads jax.
"""

import contextlib
import sys
from typing import Iterator

from efficient_lm import data
from efficient_lm.cli import common as cli
from efficient_lm.config.errors import ConfigError
from efficient_lm.config.run import RunConfig
from efficient_lm.parallel import distributed
from efficient_lm.parallel import targets
from efficient_lm.runtime import exit_codes
from efficient_lm.runtime import jax_devices
from efficient_lm.runtime import output
from efficient_lm.runtime import progress
from efficient_lm.runtime import signals
from efficient_lm.state import checkpoint
from efficient_lm.state import workdir as workdir_lib
from efficient_lm.training import compile_only as compile_only_lib
from efficient_lm.training import loop
from efficient_lm.training import prepare as config_check
from efficient_lm.training import step_memory

# The errors that are the user's to fix: one `error:` line and exit status 2.
KNOWN_ERRORS = (ConfigError, data.DataError, data.DownloadError, workdir_lib.WorkdirError,
                checkpoint.NoRestorableCheckpointError, checkpoint.CheckpointRestoreError,
                loop.NonFiniteError, targets.TargetError)


@contextlib.contextmanager
def errors_as_lines() -> Iterator[None]:
  """A mistake of the user's as one `error:` line (status 2; 3: a step that does not fit); any
  other error re-raised, after the line that names a lost process of a job, if one was."""
  try:
    yield
  except step_memory.StepTooLargeError as e:
    cli.fail(str(e), exit_codes.DOES_NOT_FIT)
  except KNOWN_ERRORS as e:
    cli.fail(str(e))
  except Exception as e:  # pylint: disable=broad-except  (a lost process? else re-raised)
    distributed.PeerWatch.explain(e)
    raise


def start_jax(coordinator_address: str | None, num_processes: int | None, process_id: int | None,
              heartbeat_timeout: int) -> None:
  """The job's processes joined (`distributed`; then only process 0 logs progress) and jax's
  devices started, before anything touches a device."""
  with errors_as_lines(), signals.phase("starting jax"):
    if distributed.initialize_distributed(coordinator_address, num_processes, process_id,
                                          heartbeat_timeout):
      progress.setup_command_logging(primary=distributed.is_primary())  # (others: warnings)
      distributed.log_job()
    jax_devices.start()


def train(run: RunConfig, workdir: str) -> None:
  """The run at the edge (`prepare`: every check that needs the devices or data), trained in
  `workdir`; its summary the last stdout line, or a stop signal's line and status."""
  with errors_as_lines():
    run, built = config_check.prepare(run)
    summary = loop.train_and_evaluate(run, workdir, built)
  if summary.get("preempted"):
    print(summary["preempted_line"], file=sys.stderr)
    signals.flush()
    sys.exit(signals.status_of(summary["preempted"]))
  output.result_json({k: v for k, v in summary.items() if k != "sample"})


def compile_only(run: RunConfig, target: str | None, num_slices: int) -> None:
  """`--compile_only`: what the train step needs per device (`compile_only` runs the edge,
  `prepare`, for the target's devices); exit status 3 when it does not fit."""
  with errors_as_lines():
    memory = compile_only_lib.compile_only(run, target, num_slices)
  output.result(step_memory.describe(memory) + ("" if memory["fits"] else " -- does not fit"))
  output.result_json(memory)
  if not memory["fits"]:
    cli.fail(f"the train step does not fit: it needs "
             f"{step_memory.gib(memory['per_device_total_bytes'])} per device, "
             f"{memory['available_is']} is {step_memory.gib(memory['per_device_available_bytes'])}; "
             f"lower it with {step_memory.fix_hint(memory)}", exit_codes.DOES_NOT_FIT)
