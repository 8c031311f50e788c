"""The fields every config shares; `configs/<family>.py` starts from `base_config()`.

Field names are a public contract (docs, tests and users rely on them). Every
section is typed: its fields are declared (default, meaning, check) in `data_config.DataConfig`,
`model_config.ModelConfig` (the shared model fields; a family's own in its config class,
`efficient_lm/families/`), `train_config.TrainConfig` and `mesh_config.MeshConfig`, and read from
there; `run.build` turns the ConfigDict into a `RunConfig`. A family's file comments only what it
adds or changes. `model.seq_len` and `model.vocab_size` are field references to the data's, so
one override changes both.
"""

import ml_collections

from efficient_lm.config import data as data_config
from efficient_lm.config import mesh as mesh_config
from efficient_lm.config import model as model_config
from efficient_lm.config import train as train_config


def base_config(model_name: str) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # The data section's fields, their defaults, meanings and checks: data_config.DataConfig.
  config.data = data = ml_collections.ConfigDict()
  for field, default in data_config.DataConfig.defaults().items():
    data[field] = default

  # The model section's shared fields, their defaults and meanings: model_config.ModelConfig
  # (a family's own: its config class beside its mixer, e.g. models/pi_attention.py).
  config.model = model = ml_collections.ConfigDict()
  model.name = model_name
  model.vocab_size = data.get_ref("vocab_size")  # always the tokenizer's size
  model.seq_len = data.get_ref("seq_len")        # always the data's window
  for field, default in model_config.ModelConfig.defaults().items():
    model[field] = default

  # The train section's fields, their defaults, meanings and checks: train_config.TrainConfig.
  config.train = train = ml_collections.ConfigDict()
  for field, default in train_config.TrainConfig.defaults().items():
    train[field] = default

  # The mesh section's fields, their defaults, meanings and checks: mesh_config.MeshConfig (the
  # rules: every model's logical axes at their defaults, efficient_lm/config/axes.py).
  config.mesh = mesh = ml_collections.ConfigDict()
  for field, default in mesh_config.MeshConfig.defaults().items():
    mesh[field] = default
  return config


def _fill(target: ml_collections.ConfigDict, source: ml_collections.ConfigDict) -> None:
  for key, value in source.items():
    if key not in target:
      target[key] = value.copy_and_resolve_references() if isinstance(
          value, ml_collections.ConfigDict) else value
    elif isinstance(value, ml_collections.ConfigDict) and isinstance(
        target[key], ml_collections.ConfigDict):
      _fill(target[key], value)


# Fields added later whose default changes what a run computes: a `config.json` written before
# them gets the behaviour it was trained with.
BEFORE_FIELD = {("data", "document_mask"): False}


def fill_defaults(config: ml_collections.ConfigDict, section: str | None = None, *,
                  saved: bool = False) -> ml_collections.ConfigDict:
  """Every field of `base_config` the config lacks, filled in place with its default (a
  `config.json` written before the field existed, a hand-written config), so the library reads
  fields, never restates a default. `saved`: the config is a run's `config.json`, and a field in
  `BEFORE_FIELD` it lacks gets the value the run was trained with. `section` ('model', ...):
  `config` is that section alone (its `name` is the model's, for the model section). Returns
  `config`."""
  name = config.name if section == "model" else config.model.name
  base = base_config(name)
  with config.unlocked():
    if saved and section is None:
      for (part, field), value in BEFORE_FIELD.items():
        if part in config and field not in config[part]:
          config[part][field] = value
    _fill(config, base[section] if section else base)
  return config
