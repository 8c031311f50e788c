"""Results on stdout, everything else on stderr.

    output.reserve_stdout()   # a command's first step: file descriptor 1 now goes to stderr
    output.result(line)       # a result line, on the real stdout
    output.result_json(record)   # a result as one line of strict JSON (`figures`: null, not NaN)
    with output.library_prints_discarded(): ...   # TFDS's announcements dropped

Native libraries and Python ones print on stdout now and then (gloo's "[Gloo] Rank 0 is connected
...", TFDS's "Downloading and preparing dataset ..."); once the command has reserved stdout all of
that lands on stderr, and stdout holds the command's results only.
"""

import contextlib
import io
import os
import sys

from efficient_lm.runtime import figures

_results = None  # the real stdout, once reserved


def reserve_stdout() -> None:
  """From now on file descriptor 1 (and `sys.stdout`) write to stderr; `result` writes to the
  original stdout. Idempotent."""
  global _results
  if _results is not None:
    return
  sys.stdout.flush()
  _results = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
  os.dup2(2, 1)
  sys.stdout = sys.stderr


def result(line: str) -> None:
  """`line` and a newline: the command's result, on stdout."""
  stream = _results if _results is not None else sys.stdout
  stream.write(line + "\n")
  stream.flush()


def result_json(record, **kwargs) -> None:
  """`record` as one line of JSON on stdout that strict parsers read (`figures.dumps`: a figure
  that is not finite is null, its reason beside it); `kwargs` go to json.dumps."""
  result(figures.dumps(record, **kwargs))


def library_prints_discarded():
  """Inside, what Python code prints on stdout is dropped (TFDS announces every dataset it prepares
  there: our own progress lines say it on stderr)."""
  return contextlib.redirect_stdout(io.StringIO())
