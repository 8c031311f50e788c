"""`python tests/inject_fault.py FAULT N ARGS...`: `efficient_lm.main ARGS` (or, with a fourth
word `evaluate` / `sample` before ARGS, that command) with one fault injected into this process
only; the other processes of a job run plain `-m efficient_lm.main`.

    SIGNAL@WHERE N    the process sends itself SIGNAL (SIGINT, SIGTERM; SIGTERM*2: twice in a
                      row) at the N-th time it reaches WHERE:
                        step        placing a train batch          eval      placing an eval batch
                        tokenizer   a document read by the tokenizer trainer (its own thread)
                        tokenizing  a chunk of documents tokenized into the token cache
                        sample      the end-of-run sample
                        compile     N ms into compiling the train step (from a timer thread)
                        commit      waiting for a checkpoint to be committed
                        evaluate    the `evaluate` command's scoring
                        generate    the `sample` command's generation
    unreadable N      its reads of checkpoint N's items fail with an I/O error (a host whose view
                      of the shared checkpoint directory is damaged)
    kill-in-save N    it is SIGKILLed just after starting the (asynchronous) save of checkpoint N
    wikitext-from:URL 0   the wikitext103 archive is downloaded from URL (a test's local server)
    not-primary 0     (a process other than 0) it fails if it reads a `text:` corpus in full or
                      trains a tokenizer: process 0 alone does that, the others read its result

The signals are real (`os.kill`), and each prints `injected: SIGNAL at <time>` on stderr first;
only their moment is chosen.
"""

import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
from efficient_lm.data import tokenizer
from efficient_lm.data import wikitext103
from efficient_lm.evaluation import scoring
from efficient_lm.inference import generation
from efficient_lm.state import checkpoint
from efficient_lm.training import evaluate as train_eval
from efficient_lm.training import step_memory

FAULT, N = sys.argv.pop(1), int(sys.argv.pop(1))
COMMAND = sys.argv.pop(1) if len(sys.argv) > 1 and sys.argv[1] in ("evaluate", "sample") else "main"
_counts: dict[str, int] = {}
_in_eval = []


def _send(name: str) -> None:
  twice = name.endswith("*2")
  sig = getattr(signal, name.removesuffix("*2"))
  print(f"injected: {sig.name} at {time.time()}", file=sys.stderr, flush=True)
  os.kill(os.getpid(), sig)
  if twice:
    os.kill(os.getpid(), sig)


def _reached(where: str) -> None:
  """WHERE reached once more: the signal, if this is the N-th time."""
  name, _, at = FAULT.partition("@")
  _counts[where] = _counts.get(where, 0) + 1
  if at == where and _counts[where] == N:
    _send(name)


def _wrap(owner, attribute: str, before) -> None:
  real = getattr(owner, attribute)

  def wrapper(*args, **kwargs):
    before(*args, **kwargs)
    return real(*args, **kwargs)

  setattr(owner, attribute, wrapper)


def _wrap_generator(owner, attribute: str, where: str) -> None:
  real = getattr(owner, attribute)

  def wrapper(*args, **kwargs):
    for item in real(*args, **kwargs):
      _reached(where)
      yield item

  setattr(owner, attribute, wrapper)


def _marking_eval(real):
  def evaluate(*args, **kwargs):
    _in_eval.append(True)
    try:
      return real(*args, **kwargs)
    finally:
      _in_eval.pop()
  return evaluate


if "@" in FAULT:
  _wrap(train_eval, "place_batch", lambda *a, **k: _reached("eval" if _in_eval else "step"))
  train_eval.evaluate = _marking_eval(train_eval.evaluate)
  _wrap_generator(tokenizer, "_lines", "tokenizer")
  _wrap(tokenizer.Tokenizer, "encode_batch", lambda *a, **k: _reached("tokenizing"))
  _wrap(generation, "sample_from_state", lambda *a, **k: _reached("sample"))
  _wrap(checkpoint.Checkpointer, "wait", lambda *a, **k: _reached("commit"))
  _wrap(scoring, "evaluate_workdir", lambda *a, **k: _reached("evaluate"))
  _wrap(generation, "generate_texts", lambda *a, **k: _reached("generate"))  # the sample command's
  if FAULT.endswith("@compile"):
    _wrap(step_memory, "compile_train_step", lambda *a, **k: threading.Timer(
        N / 1000, lambda: _send(FAULT.partition("@")[0])).start())
elif FAULT == "unreadable":
  _real_read_item = checkpoint.read_item

  def _failing_read_item(directory, step, item):
    if step == N:
      raise OSError(5, f"Input/output error (injected into this process's read of step {step})")
    return _real_read_item(directory, step, item)

  checkpoint.read_item = _failing_read_item
elif FAULT == "kill-in-save":
  _real_save = checkpoint.Checkpointer.save

  def _save_then_die(self, step, *args, **kwargs):
    _real_save(self, step, *args, **kwargs)
    if step == N:
      print(f"injected: SIGKILL at {time.time()}", file=sys.stderr, flush=True)
      os.kill(os.getpid(), signal.SIGKILL)

  checkpoint.Checkpointer.save = _save_then_die
elif FAULT == "not-primary":
  from efficient_lm.data import text_files

  def _refuse(what):
    def fail(*args, **kwargs):
      if what == "read the corpus in full" and not kwargs.get("read", True):
        return _listing(*args, **kwargs)
      raise AssertionError(f"a process other than 0 tried to {what}")
    return fail

  _listing = text_files.scan
  text_files.scan = _refuse("read the corpus in full")
  tokenizer.Tokenizer.train = _refuse("train a tokenizer")
elif FAULT.startswith("wikitext-from:"):
  wikitext103.Wikitext103.URLS = (FAULT.partition(":")[2],)  # the mirrors the builder tries
else:
  raise SystemExit(f"unknown fault {FAULT!r}")

if __name__ == "__main__":
  if COMMAND == "main":
    from efficient_lm import main
    main.run()
  else:
    import importlib
    importlib.import_module(f"efficient_lm.{COMMAND}").run()
