"""`python tests/inject_fault.py FAULT N ARGS...`: `efficient_lm.main ARGS`, with one fault injected
into this process only (the others of a job run plain `-m efficient_lm.main`):

    unreadable N      its reads of checkpoint N's items fail with an I/O error (a host whose view
                      of the shared checkpoint directory is damaged)
    sigterm-step N    it sends itself SIGTERM as it places the batch of its N-th train step
    sigterm-eval N    it sends itself SIGTERM as it places its N-th evaluation batch
    kill-in-save N    it is SIGKILLed just after starting the (asynchronous) save of checkpoint N

The signals are real (`os.kill`); only their moment is chosen.
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from efficient_lm import checkpoint  # pylint: disable=wrong-import-position
from efficient_lm import main  # pylint: disable=wrong-import-position
from efficient_lm import train  # pylint: disable=wrong-import-position

FAULT, N = sys.argv.pop(1), int(sys.argv.pop(1))
_counts = {"train": 0, "eval": 0}
_in_eval = []


def _unreadable(real):
  def read_item(directory, step, item):
    if step == N:
      raise OSError(5, f"Input/output error (injected into this process's read of step {step})")
    return real(directory, step, item)
  return read_item


def _signalling(real):
  def place_batch(*args, **kwargs):
    kind = "eval" if _in_eval else "train"
    _counts[kind] += 1
    if FAULT == f"sigterm-{'step' if kind == 'train' else 'eval'}" and _counts[kind] == N:
      print(f"injected: SIGTERM at {time.time()}", file=sys.stderr, flush=True)
      os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)
  return place_batch


def _marking_eval(real):
  def evaluate(*args, **kwargs):
    _in_eval.append(True)
    try:
      return real(*args, **kwargs)
    finally:
      _in_eval.pop()
  return evaluate


def _killed_in_save(real):
  def save(self, step, *args, **kwargs):
    real(self, step, *args, **kwargs)
    if step == N:
      os.kill(os.getpid(), signal.SIGKILL)
  return save


if FAULT == "unreadable":
  checkpoint.read_item = _unreadable(checkpoint.read_item)
elif FAULT in ("sigterm-step", "sigterm-eval"):
  train.place_batch = _signalling(train.place_batch)
  train.evaluate = _marking_eval(train.evaluate)
elif FAULT == "kill-in-save":
  checkpoint.Checkpointer.save = _killed_in_save(checkpoint.Checkpointer.save)
else:
  raise SystemExit(f"unknown fault {FAULT!r}")

if __name__ == "__main__":
  main.run()
