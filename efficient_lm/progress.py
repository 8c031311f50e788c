"""Progress from the first second: every phase longer than a few seconds says what it does and how far.

    with progress.phase("tokenizing shakespeare/train", status=lambda: f"{n:,} tokens written"):
      ...   # logs "tokenizing shakespeare/train ... 20 s: 612,000 tokens written" every 20 s

A phase is also what a stop signal interrupts (`signals.phase`: the line the command ends with
names it). Progress goes to stderr through the `efficient_lm` loggers; results go to stdout.
"""

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator

from efficient_lm import signals

log = logging.getLogger("efficient_lm.progress")
EVERY_SECONDS = 20.0  # a phase that lasts longer says how far it is this often


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


class _Ticker(threading.Thread):
  def __init__(self, what: str, status: Callable[[], str] | None, every: float):
    super().__init__(name=f"progress: {what}", daemon=True)
    self._what, self._status, self._every = what, status, every
    self._done = threading.Event()
    self._start = time.monotonic()

  def run(self) -> None:
    while not self._done.wait(self._every):
      extra = ""
      if self._status is not None:
        with contextlib.suppress(Exception):  # a status read mid-update: skip it this time
          extra = self._status() or ""
      log.info("%s ... %s%s", self._what, duration(time.monotonic() - self._start),
               f": {extra}" if extra else "")

  def stop(self) -> None:
    self._done.set()


@contextlib.contextmanager
def phase(what: str, status: Callable[[], str] | None = None,
          every: float = EVERY_SECONDS) -> Iterator[None]:
  """`what` is what the command is doing now: named to a stop signal (`signals.phase`) and, while
  it lasts, logged with the time spent (and `status()`, how far it is) every `every` seconds."""
  ticker = _Ticker(what, status, every)
  with signals.phase(what):
    ticker.start()
    try:
      yield
    finally:
      ticker.stop()
