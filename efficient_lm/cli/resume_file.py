"""A workdir's own config as a config file: `python -m efficient_lm.main --workdir=W` without
--config loads `--config=<this file>:W`, so that `--config.x=y` overrides apply on top of W's
config.json exactly as they would on top of a config file."""

import ml_collections

from efficient_lm.config import base as config_base
from efficient_lm.state import workdir


def get_config(path: str) -> ml_collections.ConfigDict:
  """The config that continues the run workdir `path` holds: its config.json (`saved_dict`: a
  tokenizer of one's own is the workdir's copy) with the fields added since at their defaults,
  `data.vocab_size` as the run asked for it (data.json's settings: config.json holds a small
  corpus's tokenizer size), and `model.vocab_size` and `model.seq_len` following the data's again,
  as in a config file, so that overrides apply on top as they would to one. WorkdirError when it
  holds no run's config."""
  wd = workdir.Workdir(path)
  try:
    saved = wd.saved_dict()
    identity = wd.saved_identity() or {}
  except (OSError, ValueError) as e:
    raise workdir.WorkdirError(f"--workdir={wd.path}: its {workdir.CONFIG} or {workdir.DATA} cannot "
                               f"be read ({e}); give --config=<the config file> it was trained "
                               "with") from None
  if saved is None:
    raise workdir.WorkdirError(f"--workdir={wd.path} has no {workdir.CONFIG}: there is no run to "
                               "continue; give --config=<a config file> to start one there")
  config = config_base.fill_defaults(ml_collections.ConfigDict(saved), saved=True)
  settings = identity.get("settings") if isinstance(identity, dict) else None
  if isinstance(settings, dict) and not config.data.tokenizer and "vocab_size" in settings:
    config.data.vocab_size = settings["vocab_size"]
  config.model.vocab_size = config.data.get_ref("vocab_size")
  config.model.seq_len = config.data.get_ref("seq_len")
  return config
