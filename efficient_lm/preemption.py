"""SIGTERM / SIGINT during training: finish the step, save, exit cleanly."""

import signal
import types


class StopRequest:
  """Context manager: while active, SIGTERM and SIGINT set `.signal_name` instead of killing.

  The training loop polls `requested` after every step, saves a checkpoint and
  returns. A second signal of the same kind restores the default behaviour, so
  an impatient Ctrl-C twice still stops at once.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signal_name: str | None = None
    self._previous = {}

  @property
  def requested(self) -> bool:
    return self.signal_name is not None

  def _handle(self, signum: int, frame: types.FrameType | None) -> None:
    del frame
    self.signal_name = signal.Signals(signum).name
    signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

  def __enter__(self) -> "StopRequest":
    for sig in self.SIGNALS:
      self._previous[sig] = signal.getsignal(sig)
      signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
