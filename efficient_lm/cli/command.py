"""The one skeleton of the five commands: what `python -m efficient_lm.<command>` does around
the body that is each command's own.

    COMMAND = command.Command(body=_sample, phase=lambda FLAGS: f"sampling from {FLAGS.workdir}",
                              define_flags=_define_flags)
    def run() -> None:
      command.run(COMMAND)

`run` installs the stop signals (`runtime.signals`: Ctrl-C and SIGTERM end the command with one
line and their exit status, in every phase), defines the command's flags, and hands absl's `app.run`
the shared flag parser (`common.parse_flags`: every command-line mistake one `error: ...` line and
exit status 2; `--help` and `--help=<model>`). The command's `main` then keeps stdout for its
result (`output.reserve_stdout`: progress and library chatter go to stderr), sets up logging
(`progress.setup_command_logging`), names the phase a stop line reports, and exits with the status
the body returns (`exit_codes`; None: 0). A body reports a mistake of the user's with
`common.error(e)` (one line, status 2). Nothing here imports jax.
"""

import contextlib
import dataclasses
import sys
from typing import Callable

from absl import flags

from efficient_lm.cli import common
from efficient_lm.runtime import output
from efficient_lm.runtime import progress
from efficient_lm.runtime import signals

Flags = flags.FlagValues


@dataclasses.dataclass(frozen=True)
class Command:
  """What one command declares; `run` does the rest."""
  body: Callable[[Flags], int | None]  # the command's work on the parsed flags: its exit status
  # What the command is doing, named in the line a stop signal ends it with ("sampling from W");
  # None: the body names its own phases.
  phase: Callable[[Flags], str] | None = None
  define_flags: Callable[[], None] | None = None  # None: defined where the module is imported
  # A training run (SIGTERM exits with `exit_codes.PREEMPTED`), or how the flags decide it.
  training: bool | Callable[[Flags], bool] = False
  parse_flags: Callable[[list[str]], list[str]] = common.parse_flags  # absl's `flags_parser`
  stopped_line: Callable[[str, str], str] = signals.stopped_line  # (signal, phase) -> the line
  discard_library_prints: bool = False  # libraries' print()s (TFDS's) dropped while the body runs


def run(command: Command) -> None:
  """The command's process: signals, flags, absl's `app.run` of `main(command)`."""
  signals.install(training=command.training if isinstance(command.training, bool) else None)
  if command.define_flags is not None:
    command.define_flags()
  signals.run_command(lambda argv: main(command, argv), command.parse_flags,
                      line=command.stopped_line)


def main(command: Command, argv: list[str]) -> None:
  """What every command does once its flags are parsed, around its body: exits with the status
  the body returns (inside its phase, as a stop there is the body's), or returns after it."""
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  if callable(command.training):
    signals.install(training=command.training(FLAGS))
  output.reserve_stdout()
  progress.setup_command_logging()  # our progress on stderr; the libraries' warnings only
  with contextlib.ExitStack() as stack:
    if command.phase is not None:
      stack.enter_context(signals.phase(command.phase(FLAGS)))
    if command.discard_library_prints:
      stack.enter_context(output.library_prints_discarded())
    status = command.body(FLAGS)
    if status is not None:
      sys.exit(status)
