"""Trains a model: `python -m efficient_lm.main --config=configs/<name>.py[:preset] [--workdir=DIR]`.

Any config field can be overridden, e.g. `--config.train.num_steps=100`.
`--workdir` defaults to `runs/<config name>[_<preset>]`; a run resumes from the
latest checkpoint in its workdir. Several processes (hosts, or one per GPU) train one
job when each runs the same command with `--coordinator_address`, `--num_processes`
and its own `--process_id`, or under SLURM / Open MPI / a Cloud TPU slice with none.
"""

import json
import logging as std_logging
import os
import sys

import jax
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from efficient_lm import checkpoint
from efficient_lm import cli
from efficient_lm import data
from efficient_lm import distributed
from efficient_lm import step_memory
from efficient_lm import targets
from efficient_lm import train
from efficient_lm import workdir as workdir_lib
from efficient_lm.validation import ConfigError

config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/dense.py or "
                                "configs/bcmt.py:128, or a shipped config by name (pi_attention, "
                                "bcmt:128).", lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs; default runs/<config name>.")
flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0, for a multi-process job; "
                    "default $JAX_COORDINATOR_ADDRESS or the cluster's (SLURM, Open MPI, Cloud TPU).")
flags.DEFINE_integer("num_processes", None, "Processes in the job; default $JAX_NUM_PROCESSES or the "
                     "cluster's; none of the three flags and no cluster: one process.")
flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes); default "
                     "$JAX_PROCESS_ID or the cluster's.")
flags.DEFINE_bool("compile_only", False, "Validate the config, compile the real train step for the "
                  "configured mesh from shapes only (no data, no training) and print what it needs "
                  "per device; the last stdout line is JSON. Exit status 3 if it does not fit.")
flags.DEFINE_string("target", None, "With --compile_only: compile for an accelerator from this host, "
                    "<platform>:<device>:<topology>, e.g. tpu:v5e:2x2, tpu:v5p:2x2x1, gpu:h100:1x1x8 "
                    "(needs the tpu / gpu extra); memory and compilation only, never speed.")
flags.DEFINE_integer("num_slices", 1, "With --target: slices joined by the data-center network "
                     "(mesh.dcn_data / mesh.dcn_fsdp split them).")
flags.mark_flags_as_required(["config"])
FLAGS = flags.FLAGS
logger = std_logging.getLogger("efficient_lm.main")


def default_workdir(config_arg: str) -> str:
  path, _, preset = config_arg.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  return os.path.join("runs", f"{name}_{preset}" if preset else name)


def setup_logging(primary: bool = True) -> None:
  """Our progress at INFO on stderr (process 0 only; others warnings); the libraries' warnings only."""
  logging.set_verbosity(logging.WARNING)
  handler = std_logging.StreamHandler(sys.stderr)
  handler.setFormatter(std_logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
  ours = std_logging.getLogger("efficient_lm")
  ours.handlers = [handler]
  ours.setLevel(std_logging.INFO if primary else std_logging.WARNING)
  ours.propagate = False


def main(argv):
  del argv
  setup_logging()
  workdir = FLAGS.workdir or default_workdir(FLAGS["config"].config_filename)
  if FLAGS.target and not FLAGS.compile_only:
    print("error: --target compiles for an accelerator without running anything; add "
          "--compile_only (or drop --target to train here)", file=sys.stderr)
    sys.exit(2)
  if FLAGS.target:
    targets.prepare_host()  # before anything starts a backend
  try:
    # Before anything touches devices; then only process 0 logs progress.
    if distributed.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                          FLAGS.process_id):
      setup_logging(primary=distributed.is_primary())
      logger.info("one job of %d processes over %d devices (%d here)", jax.process_count(),
                  jax.device_count(), jax.local_device_count())
    if FLAGS.compile_only:
      try:
        memory = train.compile_only(FLAGS.config, FLAGS.target, FLAGS.num_slices)
      except step_memory.StepTooLargeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)
      print(step_memory.describe(memory) + ("" if memory["fits"] else " -- does not fit"))
      print(json.dumps(memory))
      if not memory["fits"]:
        print(f"error: the train step does not fit: it needs "
              f"{step_memory.gib(memory['per_device_total_bytes'])} per device, "
              f"{memory['available_is']} is {step_memory.gib(memory['per_device_available_bytes'])}; "
              f"lower it with {step_memory.fix_hint(memory)}", file=sys.stderr)
        sys.exit(3)
      return
    train.train_and_evaluate(FLAGS.config, workdir)
  except KeyboardInterrupt:
    print("error: interrupted (Ctrl-C); nothing half-written was kept (the data cache, the "
          "workdir and the checkpoints are written atomically): rerun the same command to go on "
          "from the last checkpoint", file=sys.stderr)
    sys.exit(130)
  except (ConfigError, data.DataError, data.DownloadError, workdir_lib.WorkdirError,
          checkpoint.NoRestorableCheckpointError, train.NonFiniteError,
          step_memory.StepTooLargeError, targets.TargetError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def run() -> None:
  """The `efficient-lm-train` console script."""
  app.run(main, flags_parser=cli.parse_flags)


if __name__ == "__main__":
  run()
