"""`Typed`: a config's four typed sections, built once at the edge and passed down.

`training.prepare.prepare(config)` returns them (every check run, the devices' included); below the
edge the train state, the compiled step and the loop read `typed.model.d_model`,
`typed.mesh.rule_axes`, ... and never the ConfigDict again. `train_state.typed(config)` builds them
from a ConfigDict for a caller that has none (each section's own checks only): it lives above the
models, whose families declare the model section's classes.
"""

from typing import NamedTuple

from efficient_lm.config import data as data_config
from efficient_lm.config import mesh as mesh_config
from efficient_lm.config import model as model_config
from efficient_lm.config import train as train_config


class Typed(NamedTuple):
  """The four typed sections of a config."""
  data: data_config.DataConfig
  model: model_config.ModelConfig
  train: train_config.TrainConfig
  mesh: mesh_config.MeshConfig


__all__ = ["Typed"]
