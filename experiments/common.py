"""Helpers the experiment scripts share."""

import os

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
