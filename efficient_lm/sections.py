"""`Typed`: a config's four typed sections, built once at the edge and passed down.

`config_check.prepare(config)` returns them (every check run, the devices' included); below the
edge the train state, the compiled step and the loop read `typed.model.d_model`,
`typed.mesh.rule_axes`, ... and never the ConfigDict again. `typed(config)` builds them from a
ConfigDict for a caller that has none (each section's own checks only). Imports no data pipeline.
"""

from typing import NamedTuple

from efficient_lm import data_config
from efficient_lm import mesh_config
from efficient_lm import model_config
from efficient_lm import train_config
from efficient_lm.models import registry


class Typed(NamedTuple):
  """The four typed sections of a config."""
  data: data_config.DataConfig
  model: model_config.ModelConfig
  train: train_config.TrainConfig
  mesh: mesh_config.MeshConfig


def typed(config) -> Typed:
  """The typed sections of `config` (a ConfigDict; a `Typed` as it is), each through its edge
  (`Section.from_mapping`; the model's through its family's class, `registry.family`)."""
  if isinstance(config, Typed):
    return config
  name = config.model.get("name")
  return Typed(data_config.DataConfig.from_mapping(config.data),
               registry.family(name).from_mapping(config.model, owner=f"model.name={name!r}"),
               train_config.TrainConfig.from_mapping(config.train),
               mesh_config.MeshConfig.from_mapping(config.mesh))


__all__ = ["Typed", "typed"]
