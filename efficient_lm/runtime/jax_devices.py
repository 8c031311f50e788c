"""JAX's devices, brought up once and quietly: the native start-up chatter of a backend this host
does not use (libtpu probing for TPU chips on a CPU or GPU host) is kept out of a run's output.

    jax_devices.start()                    # after `distributed.initialize_distributed`
    jax_devices.quietly(fn)                # fn() with its native chatter kept back
    with jax_devices.native_stderr_captured() as captured: ...   # the same for any native step

What native code prints on the process's stderr while captured is kept in a temporary file and
shown only if the step fails (or, for `start`, when the devices are TPUs: then it is the runtime
in use speaking).
"""

import contextlib
import os
import sys
import tempfile
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def native_stderr_captured() -> Iterator[Callable[[], str]]:
  """File descriptor 2 redirected to a temporary file while inside; yields a function returning
  what was written so far. Python's own sys.stderr writes are captured too (keep the block short)."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as sink:
    os.dup2(sink.fileno(), 2)

    def captured() -> str:
      sink.flush()
      sink.seek(0)
      return sink.read().decode("utf-8", "replace")

    try:
      yield captured
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)


def replay(text: str) -> None:
  if text.strip():
    sys.stderr.write(text if text.endswith("\n") else text + "\n")
    sys.stderr.flush()


def quietly(fn: Callable[[], T], show: Callable[[T], bool] = lambda result: False) -> T:
  """`fn()` with what native code prints on stderr meanwhile kept back: shown if it raises, or if
  `show(result)`."""
  error = result = None
  with native_stderr_captured() as captured:
    try:
      result = fn()
    except BaseException as e:  # pylint: disable=broad-except  (re-raised below, with the chatter)
      error = e
    text = captured()
  if error is not None:
    replay(text)
    raise error
  if show(result):
    replay(text)
  return result


def start() -> list:
  """`jax.devices()`, their backends started with native chatter kept back unless the start fails
  or the devices are TPUs (then it is the runtime in use speaking)."""
  import jax  # pylint: disable=import-outside-toplevel
  return quietly(jax.devices, show=lambda devices: devices[0].platform == "tpu")
