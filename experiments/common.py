"""Helpers the experiment scripts share."""

import contextlib
import os
import time

import ml_collections

from efficient_lm import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(spec: str) -> ml_collections.ConfigDict:
  """'configs/bcmt.py:128' (relative to the repository) or 'bcmt:128' -> that config, as the
  entry point reads it (`efficient_lm.cli.load_config`)."""
  path, colon, preset = spec.partition(":")
  if not os.path.isabs(path) and os.path.isfile(os.path.join(REPO, path)):
    spec = os.path.join(REPO, path) + colon + preset
  return cli.load_config(spec)


@contextlib.contextmanager
def paused(path: str | None, who: str = "a measurement"):
  """Creates `path` while timing (background jobs that watch it, such as
  `experiments/seed_level_runs.sh`'s, stop), removes it after."""
  if not path:
    yield
    return
  with open(path, "w") as f:
    f.write(f"{who} {os.getpid()}\n")
  time.sleep(12)  # the pollers look every 10 s
  try:
    yield
  finally:
    os.remove(path)
