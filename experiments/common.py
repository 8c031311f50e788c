"""Helpers the experiment scripts share."""

import importlib.util
import os

import ml_collections

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(spec: str) -> ml_collections.ConfigDict:
  """'configs/bcmt.py:128' -> that file's get_config('128'), as the entry point reads it."""
  path, _, preset = spec.partition(":")
  if not os.path.isabs(path):
    path = os.path.join(REPO, path)
  module_spec = importlib.util.spec_from_file_location("bench_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(preset or None)
