"""A workdir's own config as a config file: `python -m efficient_lm.main --workdir=W` without
--config loads `--config=<this file>:W`, so that `--config.x=y` overrides apply on top of W's
config.json exactly as they would on top of a config file (`workdir.Workdir.resume_config`)."""

import ml_collections

from efficient_lm.state import workdir


def get_config(path: str) -> ml_collections.ConfigDict:
  return workdir.Workdir(path).resume_config()
