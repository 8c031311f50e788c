"""Progress from the first second: every phase longer than a few seconds says what it does and how far.

    with progress.phase("tokenizing shakespeare/train", status=lambda: f"{n:,} tokens written"):
      ...   # logs "tokenizing shakespeare/train ... 20 s: 612,000 tokens written" every 20 s

A phase is also what a stop signal interrupts (`signals.phase`: the line the command ends with
names it). A phase inside another (the same thread) starts no ticker of its own: the outer one's
line names it and its status while it lasts, so one line comes every `every` seconds.

Progress goes to stderr through the `efficient_lm` loggers; results go to stdout. The commands set
that up first (`setup_command_logging`); a call from Python (a notebook, a script) gets it on its
first phase or training run (`show`), unless its own logging already shows our lines.
"""

import contextlib
import logging
import sys
import threading
import time
from typing import Callable, Iterator

from efficient_lm.runtime import signals

log = logging.getLogger("efficient_lm.runtime.progress")
EVERY_SECONDS = 20.0  # a phase that lasts longer says how far it is this often
LIBRARY_LOGGER = "efficient_lm"
FORMAT, TIME_FORMAT = "%(asctime)s %(message)s", "%H:%M:%S"  # "05:25:30 step 40/700 ..."


def duration(seconds: float) -> str:
  """'35 s', '4m05s', '1h02m03s'."""
  seconds = int(max(seconds, 0))
  if seconds < 60:
    return f"{seconds} s"
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def size(num_bytes: float) -> str:
  """'812 KB', '45.2 MB', '1.3 GB' (decimal units)."""
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if num_bytes >= scale:
      return f"{num_bytes / scale:.1f} {unit}" if unit != "KB" else f"{num_bytes / scale:.0f} KB"
  return f"{int(num_bytes)} bytes"


class StderrHandler(logging.StreamHandler):
  """Lines as `05:25:30 message` on whatever `sys.stderr` is when one is written (a notebook's
  cell output, a command's stderr after `output.reserve_stdout`)."""

  def __init__(self):
    super().__init__()
    self.setFormatter(logging.Formatter(FORMAT, TIME_FORMAT))

  @property
  def stream(self):
    return sys.stderr

  @stream.setter
  def stream(self, value) -> None:
    del value  # (StreamHandler's constructor sets it; the stream is always sys.stderr's)


class _LibraryChatter(logging.Filter):
  """TFDS's warnings about its own folders ("Variant folder ... has no dataset_info.json"): not
  the run's business. Errors still pass."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR or "tensorflow_datasets" not in record.pathname


def setup_command_logging(primary: bool = True) -> None:
  """A command's logging, its first step: our progress at INFO on stderr (process 0 only; the
  others warnings), the libraries' warnings only (absl's verbosity)."""
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
  absl_logging.set_verbosity(absl_logging.WARNING)
  absl_logger = logging.getLogger("absl")
  if not any(isinstance(f, _LibraryChatter) for f in absl_logger.filters):
    absl_logger.addFilter(_LibraryChatter())
  ours = logging.getLogger(LIBRARY_LOGGER)
  ours.handlers = [StderrHandler()]
  ours.setLevel(logging.INFO if primary else logging.WARNING)
  ours.propagate = False


def show() -> None:
  """Progress visible from Python without any set-up, and never twice: called on the first phase
  (and by `train.train_and_evaluate`). Nothing changes where the `efficient_lm` logger already has
  a handler or a level (a command's set-up, or the user's choice: `logging.getLogger(
  "efficient_lm").setLevel(logging.WARNING)` keeps the library quiet). Its level becomes INFO; the
  lines go through the root logger's handlers where someone set them up to show INFO lines (the
  root at INFO, as `logging.basicConfig(level=logging.INFO)` leaves it, or a handler of its own
  kind: absl's, pytest's, a file's). Otherwise the root holds nothing, or only the plain stderr
  handler that absl's first log line installs (`logging.basicConfig()`, which orbax's import
  triggers): our logger gets its own `StderrHandler` and no longer passes lines up, so none
  shows twice."""
  ours = logging.getLogger(LIBRARY_LOGGER)
  if ours.handlers or ours.level != logging.NOTSET:
    return
  ours.setLevel(logging.INFO)
  root = logging.getLogger()
  shows_info = [h for h in root.handlers if h.level <= logging.INFO]
  if shows_info and (root.getEffectiveLevel() <= logging.INFO or
                     any(type(h) is not logging.StreamHandler for h in shows_info)):
    return
  ours.addHandler(StderrHandler())
  ours.propagate = False


_local = threading.local()  # .frames: this thread's phases, outermost first


def _frames() -> list:
  if not hasattr(_local, "frames"):
    _local.frames = []
  return _local.frames


class _Ticker(threading.Thread):
  """Logs the phases of `frames` (the outermost first: its name, the time since it began, then
  each status, an inner phase's with its name) every `every` seconds."""

  def __init__(self, frames: list, every: float):
    super().__init__(name=f"progress: {frames[0][0]}", daemon=True)
    self._frames, self._every = frames, every
    self._done = threading.Event()
    self._start = time.monotonic()

  def run(self) -> None:
    while not self._done.wait(self._every):
      frames, parts = list(self._frames), []
      if not frames or self._done.is_set():  # the phase ended as this line came due
        return
      for i, (what, status) in enumerate(frames):
        extra = ""
        if status is not None:
          with contextlib.suppress(Exception):  # a status read mid-update: skip it this time
            extra = status() or ""
        if i == 0:
          parts += [extra] if extra else []
        else:
          parts.append(f"{what}: {extra}" if extra else what)
      log.info("%s ... %s%s", frames[0][0], duration(time.monotonic() - self._start),
               f": {'; '.join(parts)}" if parts else "")

  def stop(self) -> None:
    self._done.set()


@contextlib.contextmanager
def phase(what: str, status: Callable[[], str] | None = None,
          every: float = EVERY_SECONDS) -> Iterator[None]:
  """`what` is what the command is doing now: named to a stop signal (`signals.phase`) and, while
  it lasts, logged with the time spent (and `status()`, how far it is) every `every` seconds; the
  first phase of a call from Python makes the lines visible (`show`)."""
  frames = _frames()
  ticker = None
  if not frames:
    show()
  frames.append((what, status))
  try:
    with signals.phase(what):
      if len(frames) == 1:
        ticker = _Ticker(frames, every)
        ticker.start()
      yield
  finally:
    if ticker is not None:
      ticker.stop()
    frames.pop()
