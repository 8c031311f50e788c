"""Trains a model: `python -m efficient_lm.main --config=configs/<name>.py[:preset] [--workdir=DIR]`.

Any config field can be overridden, e.g. `--config.train.num_steps=100`.
`--workdir` defaults to `runs/<config name>[_<preset>]`; a run resumes from the
latest checkpoint in its workdir. `--workdir=DIR` alone (no --config) continues the run DIR holds
from its config.json, overrides applied on top. Several processes (hosts, or one per GPU) train one
job when each runs the same command with `--coordinator_address`, `--num_processes`
and its own `--process_id`, or under SLURM / Open MPI / a Cloud TPU slice with none.

Progress goes to stderr, the result (one JSON line) to stdout. Ctrl-C (SIGINT) and SIGTERM stop
it cleanly in every phase; the exit statuses are `exit_codes`' (docs/operations.md). Only light
modules are imported here: a mistake on the command line answers before jax starts.
"""

from efficient_lm.runtime import signals

signals.install()  # first: Ctrl-C works while the rest is imported

# pylint: disable=wrong-import-position
import logging as std_logging
import os

from absl import flags
from ml_collections import config_flags

from efficient_lm import families
from efficient_lm.cli import command
from efficient_lm.cli import common as cli
from efficient_lm.cli import help as help_lib
from efficient_lm.cli import resume_file as workdir_config
from efficient_lm.config import run as config_run
from efficient_lm.config.errors import ConfigError
from efficient_lm.config.run import RunConfig
from efficient_lm.state import workdir as workdir_lib

config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/dense.py or "
                                "configs/bcmt.py:128, or a shipped config by name (pi_attention, "
                                "bcmt:128); required unless --workdir holds a run to continue.",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs; default runs/<config name>. "
                    "Alone (no --config): continues the run it holds from its config.json, "
                    "--config.<field> overrides on top.")
flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0, for a multi-process job; "
                    "default $JAX_COORDINATOR_ADDRESS or the cluster's (SLURM, Open MPI, Cloud TPU).")
flags.DEFINE_integer("num_processes", None, "Processes in the job; default $JAX_NUM_PROCESSES or the "
                     "cluster's; none of the three flags and no cluster: one process.")
flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes); default "
                     "$JAX_PROCESS_ID or the cluster's.")
flags.DEFINE_integer("heartbeat_timeout", 100, "Multi-process jobs: seconds of silence after which "
                     "a process counts as lost; the others then stop with one error line (exit "
                     "status 4).")
flags.DEFINE_bool("compile_only", False, "Validate the config, compile the real train step for the "
                  "configured mesh from shapes only (no data, no training) and print what it needs "
                  "per device; the last stdout line is JSON. Exit status 3 if it does not fit.")
flags.DEFINE_string("target", None, "With --compile_only: compile for an accelerator from this host, "
                    "<platform>:<device>:<topology>, e.g. tpu:v5e:2x2, tpu:v5p:2x2x1, gpu:h100:1x1x8 "
                    "(needs the tpu / gpu extra); memory and compilation only, never speed.")
flags.DEFINE_integer("num_slices", 1, "With --target: slices joined by the data-center network "
                     "(mesh.dcn_data / mesh.dcn_fsdp split them).")
FLAGS = flags.FLAGS
logger = std_logging.getLogger("efficient_lm.main")


def default_workdir(config_arg: str) -> str:
  path, _, preset = config_arg.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  return os.path.join("runs", f"{name}_{preset}" if preset else name)


def stopped_line(signal_name: str, phase: str) -> str:
  """The one line a command stopped by a signal outside the training loop ends with."""
  return (f"stopped by {signal_name} while {phase}: nothing was left half-written (the data cache, "
          "the workdir and the checkpoints hold only complete files); rerun the same command to "
          "go on")


def _train(FLAGS) -> None:  # pylint: disable=invalid-name,redefined-outer-name
  """The command's body (`command.main` has set up stdout and logging)."""
  workdir = FLAGS.workdir or default_workdir(FLAGS["config"].config_filename)
  if FLAGS.target and not FLAGS.compile_only:
    cli.fail("--target compiles for an accelerator without running anything; add --compile_only "
             "(or drop --target to train here)")
  _run(workdir)


def _run(workdir: str) -> None:
  try:  # the one RunConfig of the command: every section's declared checks, before jax starts
    run = config_run.build(FLAGS.config, families.CLASSES)
  except ConfigError as e:
    cli.fail(str(e))
  if FLAGS.target:  # the extra and the topology checked before the accelerator's plugin loads
    # Imported here: it loads jax, needed only with --target.
    from efficient_lm.parallel import targets  # pylint: disable=import-outside-toplevel
    try:
      targets.check(FLAGS.target)
    except targets.TargetError as e:
      cli.fail(str(e))
    targets.prepare_host()  # before anything starts a backend
  if not FLAGS.compile_only:  # the folder, then what config.json and data.json answer: before jax
    try:
      workdir_lib.check_usable(workdir, run)
      workdir_lib.Workdir(workdir).check_before_start(run)
    except workdir_lib.WorkdirError as e:
      cli.fail(str(e))
  if run.data.tokenizer:  # the given file, and a --config.data.vocab_size against it
    try:
      _check_given_tokenizer(run)
    except ConfigError as e:
      cli.fail(str(e))
  what = "compiling" if FLAGS.compile_only else f"training into {workdir}"
  logger.info("%s (%s): %s; starting jax", run.model.name, config_source(), what)
  # Imported here: jax loads only after the flags and the checks above.
  from efficient_lm.cli import train_run  # pylint: disable=import-outside-toplevel
  train_run.start_jax(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                      FLAGS.heartbeat_timeout)
  if FLAGS.compile_only:
    train_run.compile_only(run, FLAGS.target, FLAGS.num_slices)
  else:
    train_run.train(run, workdir)


def _check_given_tokenizer(run: RunConfig) -> None:
  """`data.tokenizer`'s file (the data's checks) and a `--config.data.vocab_size` given beside it,
  which must be the tokenizer's size (it sets data.vocab_size); ConfigError otherwise."""
  # Imported here: the data package, needed only with data.tokenizer.
  from efficient_lm.data import config as data_config  # pylint: disable=import-outside-toplevel
  size = data_config.validate(run.data).vocab_size
  given = FLAGS["config"].override_values.get("data.vocab_size")
  if given is not None and given != size:
    raise ConfigError(f"--config.data.vocab_size={given!r} disagrees with data.tokenizer="
                      f"{run.data.tokenizer!r}, which has {size} ids; drop --config.data.vocab_size "
                      f"(the tokenizer sets it) or give {size}")


def parse_flags(argv: list[str]) -> list[str]:
  """`cli.parse_flags`, where `--workdir=W` without --config continues W: its own config
  (`workdir_config`: config.json, as the run asked for it) stands for the config file, and
  `--config.<field>` overrides apply on top. Neither: one `error:` line, status 2."""
  if help_lib.requested(argv) is None and not any(a.startswith("--config=") for a in argv[1:]):
    given = _workdir_arg(argv[1:])
    if not given:
      cli.fail("--config is missing: give a config file or a shipped config (e.g. "
               "--config=configs/pi_attention.py, --config=bcmt:128) to start a run, or "
               "--workdir=<a workdir a run wrote> alone to continue the run it holds")
    try:
      workdir_config.get_config(given)
    except workdir_lib.WorkdirError as e:
      cli.fail(str(e))
    argv = [argv[0], f"--config={workdir_config.__file__}:{given}", *argv[1:]]
  return cli.parse_flags(argv)


def _workdir_arg(args: list[str]) -> str | None:
  """The value of `--workdir=W` (or `--workdir W`) in `args`, the last one given; None if none."""
  found = None
  for i, arg in enumerate(args):
    if arg == "--":
      break
    if arg.startswith("--workdir="):
      found = arg[len("--workdir="):]
    elif arg == "--workdir" and i + 1 < len(args):
      found = args[i + 1]
  return found


def config_source() -> str:
  """What the run's config came from: the config file (`:preset`), or the workdir's config.json."""
  path, _, rest = FLAGS["config"].config_filename.partition(":")
  if os.path.abspath(path) == os.path.abspath(workdir_config.__file__):
    return os.path.join(rest, "config.json")
  return FLAGS["config"].config_filename


# (The flags are defined above, as this module is imported.)
COMMAND = command.Command(body=_train, training=lambda FLAGS: not FLAGS.compile_only,
                          parse_flags=parse_flags, stopped_line=stopped_line)


def run() -> None:
  """The command: `python -m efficient_lm.main` and the `efficient-lm-train` console script
  (`efficient_lm.main.run`)."""
  command.run(COMMAND)
