"""SIGINT and SIGTERM in every phase of every command: one handler, installed first.

    signals.install(training=True)          # the first line of a command's `main`
    with signals.phase("tokenizing shakespeare/train"):  # what a stop interrupts, for its line
      ...
    with signals.deferred("saving a checkpoint at the next step"):  # the training loop
      if signals.requested(): ...           # a request it polls: save, then stop

Outside `deferred`, a first signal raises `Interrupted` in the main thread at once, that is where
Python next runs: a native call that waits on a signal-aware event (an XLA compile, a thread join,
a subprocess poll) gives way within a second. Everything a command writes is written beside its
place and renamed (the data cache, the workdir, Orbax's checkpoints), and the `finally` around
each temporary file removes it, so unwinding keeps nothing half-written. Inside `deferred` a
first signal only records the request (and says so on stderr): the loop finishes its step, saves
and returns. A second signal, in any phase, stops at once (`os._exit`: no clean-up, no waiting).

`exit_now(status, line)` ends a stopped command without tearing the interpreter down. Tearing
down is what crashed a Ctrl-C during a compile (exit -11): XLA compiles in its own thread, which
goes on after Python unwinds and segfaults on the client the teardown freed under it.

Signals ignored at start (a job started with `&` from a script: its shell ignores SIGINT for it)
are caught too: `kill -INT` stops such a job like Ctrl-C stops a foreground one.
"""

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Callable, Iterator

from efficient_lm.runtime import exit_codes

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
  """A stop signal, raised where the main thread was (a BaseException, as KeyboardInterrupt is:
  `except Exception` does not swallow it)."""

  def __init__(self, signal_name: str, phase: str):
    super().__init__(f"{signal_name} while {phase}")
    self.signal_name = signal_name
    self.phase = phase


class _State:
  def __init__(self):
    self.installed = False
    self.training = False        # SIGTERM means "preempted, resumable" (exit_codes.PREEMPTED)
    self.signal_name: str | None = None
    self.count = 0
    self.deferred: list[str] = []  # notes of the enclosing `deferred` blocks, innermost last
    self.phases: list[str] = []
    self.previous: dict = {}
    self.before_exit: list = []  # called by `exit_now` first (a multi-process job leaves together)


_state = _State()


def _write(line: str) -> None:
  """One line on stderr from a signal handler: straight to the file descriptor (the handler may
  run while the main thread is inside a write to sys.stderr)."""
  try:
    os.write(2, (line.rstrip("\n") + "\n").encode("utf-8", "replace"))
  except OSError:
    pass


def status_of(signal_name: str) -> int:
  """The exit status a stop by `signal_name` ends with."""
  if signal_name == "SIGINT":
    return exit_codes.INTERRUPTED
  return exit_codes.PREEMPTED if _state.training else exit_codes.TERMINATED


def _handle(signum: int, frame) -> None:
  del frame
  name = signal.Signals(signum).name
  _state.count += 1
  if _state.count > 1:
    where = current_phase()
    _write(f"error: a second signal ({name}) while {where}: stopped at once; anything being "
           "written was left unfinished (never renamed into place); rerun the same command")
    flush()
    os._exit(status_of(name))  # (no `before_exit`: at once means at once)
  _state.signal_name = name
  if _state.deferred:
    _write(f"{name} received: {_state.deferred[-1]}, then stopping (send it again to stop at "
           "once)")
    return
  raise Interrupted(name, current_phase())


def install(*, training: bool | None = None) -> None:
  """SIGINT and SIGTERM handled by this module from now on (main thread only); `training`: a
  training run, whose SIGTERM exit status is `exit_codes.PREEMPTED`. Idempotent; call it again
  after something else (a native library) took the signals over."""
  if training is not None:
    _state.training = training
  if threading.current_thread() is not threading.main_thread():
    return
  for sig in SIGNALS:
    previous = signal.signal(sig, _handle)
    if not _state.installed:
      _state.previous[sig] = previous
  _state.installed = True


def uninstall() -> None:
  """The handlers `install` replaced, back (for a library caller; the commands never need it)."""
  if not _state.installed or threading.current_thread() is not threading.main_thread():
    return
  for sig, previous in _state.previous.items():
    signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
  _state.installed = False
  _state.previous = {}


def requested() -> str | None:
  """The signal that asked this process to stop ('SIGINT', 'SIGTERM'), or None."""
  return _state.signal_name


def check() -> None:
  """A safe point: raises `Interrupted` if a stop was requested (while deferred)."""
  if _state.signal_name is not None:
    raise Interrupted(_state.signal_name, current_phase())


def reset() -> None:
  """Forgets a handled request (a library caller that stopped a run and starts another)."""
  _state.signal_name = None
  _state.count = 0


@contextlib.contextmanager
def deferred(note: str) -> Iterator[None]:
  """Inside: a first signal is a request that the code polls with `requested()`; `note` says what
  happens next ("saving a checkpoint at the next step"). Installs the handler for its duration
  when nothing did (a library caller: a notebook's Ctrl-C stops the loop with a checkpoint)."""
  installed_here = not _state.installed and threading.current_thread() is threading.main_thread()
  if installed_here:
    install()
  check()  # a request from before (its exception swallowed on the way: see `phase`)
  _state.deferred.append(note)
  try:
    yield
  finally:
    _state.deferred.pop()
    if installed_here:  # a library caller: the next run starts afresh
      uninstall()
      reset()


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
  """Names what the command is doing ("compiling the train step"), for the line a stop ends with.

  Entering and leaving a phase (outside `deferred`) is also a safe point: a request whose
  exception was swallowed where the handler happened to run (Python runs handlers between any two
  bytecodes, a `__del__` or a library's `except BaseException` included) stops the command here."""
  if not _state.deferred:
    check()
  _state.phases.append(what)
  try:
    yield
    if not _state.deferred:
      check()  # still inside: the stop is named for the phase that swallowed it
  finally:
    _state.phases.pop()


def current_phase() -> str:
  return _state.phases[-1] if _state.phases else "starting"


def flush() -> None:
  """Everything buffered (logging handlers, stdout, stderr) written out."""
  for handler in logging.getLogger("efficient_lm").handlers + logging.getLogger().handlers:
    with contextlib.suppress(Exception):
      handler.flush()
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(Exception):
      stream.flush()


def before_exit(fn) -> None:
  """`fn()` runs in `exit_now` before the process ends (`distributed`: the job's processes leave
  the coordination service together)."""
  _state.before_exit.append(fn)


def stopped_line(signal_name: str, phase: str) -> str:
  """The line a command stopped by a signal outside a training loop ends with."""
  return f"stopped by {signal_name} while {phase}; rerun the same command"


def run_command(main: Callable[[list[str]], None], flags_parser: Callable[[list[str]], list[str]],
                *, line: Callable[[str, str], str] = stopped_line) -> None:
  """`absl.app.run(main)` for a console script, this module's handler installed first: a stop that
  unwinds out of `main` ends the process with its status (`status_of`) and `line(signal, phase)`
  on stderr (`exit_now`: no teardown under a compile that is still running)."""
  from absl import app  # pylint: disable=import-outside-toplevel
  install()
  try:
    app.run(main, flags_parser=flags_parser)
  except Interrupted as e:
    exit_now(status_of(e.signal_name), line(e.signal_name, e.phase))


def exit_now(status: int, line: str | None = None) -> None:
  """Ends the process with `status` after `line` on stderr, without interpreter teardown (native
  threads such as an abandoned compile may still run: see the module docstring)."""
  if line:
    print(line, file=sys.stderr)
  flush()
  for fn in _state.before_exit:
    with contextlib.suppress(BaseException):
      fn()
  flush()
  os._exit(status)
