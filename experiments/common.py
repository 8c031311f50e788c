"""Helpers the experiment scripts share."""

import contextlib
import json
import os
import time

import ml_collections

from efficient_lm import families
from efficient_lm.cli import common as cli
from efficient_lm.config import run as config_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(spec: str) -> ml_collections.ConfigDict:
  """'configs/bcmt.py:128' (relative to the repository) or 'bcmt:128' -> that config, as the
  entry point reads it (`efficient_lm.cli.common.load_config`)."""
  path, colon, preset = spec.partition(":")
  if not os.path.isabs(path) and os.path.isfile(os.path.join(REPO, path)):
    spec = os.path.join(REPO, path) + colon + preset
  return cli.load_config(spec)


def build(config: ml_collections.ConfigDict) -> config_run.RunConfig:
  """The `RunConfig` of `config` (a config file's, its fields changed as `--config.*` overrides
  would change them), typed and checked as the command lines build it (`config.run.build`): what
  everything below the command lines takes."""
  return config_run.build(config, families.CLASSES)


def write_json(path: str, obj) -> None:
  """Writes `obj` to `path` whole or not at all: a temporary file beside it (this process's own),
  then a rename, so a run killed mid-write leaves the previous results, never a torn file."""
  parent = os.path.dirname(path)
  if parent:
    os.makedirs(parent, exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(obj, f, indent=1)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):  # the dump failed: the previous file stands, no stray temporary
      os.remove(tmp)


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
