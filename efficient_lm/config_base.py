"""The fields every config shares; `configs/<family>.py` starts from `base_config()`.

Field names are a public contract (docs, tests and users rely on them). Every
field is commented here once, but the typed sections': the data and train sections' fields are
declared (default, meaning, check) in `data_config.DataConfig` and `train_config.TrainConfig`,
the model section's shared ones in
`model_config.ModelConfig` and a family's in its config class. A family's file
comments only what it adds or changes. `model.seq_len` and `model.vocab_size` are field
references to the data's, so one override changes both.
"""

import ml_collections

from efficient_lm import axes
from efficient_lm import data_config
from efficient_lm import model_config
from efficient_lm import train_config


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

  config.mesh = mesh = ml_collections.ConfigDict()
  # Devices along each mesh axis; exactly one may be -1 (every device the others leave).
  mesh.data = 1                     # batch split, parameters replicated (plain data parallelism)
  mesh.fsdp = -1                    # batch split and parameters / optimizer state sharded (FSDP)
  mesh.tensor = 1                   # heads, MLP width and vocabulary split (tensor parallelism)
  mesh.context = 1                  # the sequence split (context parallelism, ring ops)
  # Over several TPU slices (the data-center network between them): each axis above is the
  # devices inside a slice, times these slices; one may be -1 (the slices the other leaves).
  mesh.dcn_data = -1                # slices along `data` (gradients all-reduced once a step)
  mesh.dcn_fsdp = 1                 # slices along `fsdp` (weights gathered across slices: costly)
  mesh.shard_optimizer_over_data = False  # also split the optimizer state over `data` (ZeRO-1)
  mesh.max_replicated_fraction = 0.05  # most of the parameters every device may hold whole
                                    # (fsdp or tensor > 1); above it (and over 1M of them)
                                    # a config error names them
  # Logical parameter axes -> mesh axes ('' = replicated; 'data,fsdp' = both): the decoder's and
  # every model's own, at their defaults (efficient_lm/axes.py).
  mesh.rules = axes.default_rules(axes.all_axes())
  # Logical activation axes -> mesh axes (`embed`, `heads`, `kv`, `mlp`, `vocab`; the batch and
  # sequence dimensions go where the batch is placed): see sharding.constrain.
  mesh.activation_rules = axes.default_activation_rules()
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
