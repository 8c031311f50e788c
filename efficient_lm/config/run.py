"""`RunConfig`: a run's whole config, typed; the one form of the config below the command lines.

    run = config_run.build(config, families.CLASSES)  # a config file's ConfigDict, overrides applied
    run.model.d_model, run.mesh.rule_axes, ...        # every section typed, every declared check run
    run.with_vocab(383)                               # a derived value is a new RunConfig
    RunConfig.from_json(run.to_json(), families.CLASSES)  # config.json, written and read back

The ml-collections config files and their `--config.<field>=<value>` overrides stay the user's
interface; `build` turns what they give (a ConfigDict, or the dict of a run's config.json) into
the four typed sections once, each through its declarations (`Section.from_mapping`: a field it
lacks takes its default, and every field's checks and the section's rules run), the model's
through its family's class, `classes[model.name]`, which the caller hands in (the families'
classes sit above this wing, in `efficient_lm.families`). Imports no jax.
"""

import dataclasses
import json
from typing import Any, Mapping

from efficient_lm.config.base import BEFORE_FIELD
from efficient_lm.config.data import DataConfig
from efficient_lm.config.errors import require
from efficient_lm.config.mesh import MeshConfig
from efficient_lm.config.model import ModelConfig
from efficient_lm.config.train import TrainConfig

SECTIONS = ("data", "model", "train", "mesh")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The four typed sections of a run's config. `model.vocab_size` is always `data.vocab_size`
  (the tokenizer's size): `with_vocab` changes both."""
  data: DataConfig
  model: ModelConfig
  train: TrainConfig
  mesh: MeshConfig

  def __post_init__(self) -> None:
    if self.model.vocab_size != self.data.vocab_size:
      raise ValueError(f"model.vocab_size={self.model.vocab_size} differs from data.vocab_size="
                       f"{self.data.vocab_size}; the model's follows the data's: use with_vocab")

  def with_vocab(self, vocab_size: int) -> "RunConfig":
    """The same run with a vocabulary of `vocab_size` (`data.vocab_size` and `model.vocab_size`,
    every check run again): what the tokenizer fixes (a given `data.tokenizer`'s size, a small
    corpus's trained one)."""
    return dataclasses.replace(self, data=dataclasses.replace(self.data, vocab_size=vocab_size),
                               model=dataclasses.replace(self.model, vocab_size=vocab_size))

  def to_dict(self) -> dict[str, dict[str, Any]]:
    """{section: {field: value}}: what config.json holds (the mesh's rules as dicts)."""
    return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

  def to_json(self) -> str:
    """config.json's text (`from_json` reads it back into an equal RunConfig)."""
    return json.dumps(self.to_dict(), indent=2)

  @classmethod
  def from_json(cls, text: str, classes: Mapping[str, type[ModelConfig]]) -> "RunConfig":
    """The RunConfig of a config.json's text, written by this library or an earlier one (`build`
    with `saved=True`)."""
    return build(json.loads(text), classes, saved=True)


def build(config: Mapping, classes: Mapping[str, type[ModelConfig]], *,
          saved: bool = False) -> RunConfig:
  """The RunConfig of `config` (a ConfigDict, or any mapping of the four sections: a run's
  config.json), each section typed through its declarations; `classes` maps `model.name` to its
  family's config class (`efficient_lm.families.CLASSES`). A ConfigError names the first field
  that is missing, unknown or refused by its checks. `model.vocab_size` is `data.vocab_size`; a
  model section without `seq_len` takes `data.seq_len`. `saved`: `config` is a run's
  config.json, and a field of `BEFORE_FIELD` it lacks (written before that field existed) gets
  the value the run was trained with."""
  for section in SECTIONS:
    require(section in config, f"config.{section}", None, "is missing",
            "start from a file in configs/, which defines every section")
  sections = {name: dict(config[name].items()) for name in SECTIONS}
  if saved:
    for (part, field), value in BEFORE_FIELD.items():
      sections[part].setdefault(field, value)
  data = DataConfig.from_mapping(sections["data"])
  model = sections["model"]
  name = model.get("name")
  require(name in classes, "model.name", name, "is not a known model",
          f"use one of {', '.join(sorted(classes))}")
  model = dict(model, vocab_size=data.vocab_size, seq_len=model.get("seq_len", data.seq_len))
  return RunConfig(data=data,
                   model=classes[name].from_mapping(model, owner=f"model.name={name!r}"),
                   train=TrainConfig.from_mapping(sections["train"]),
                   mesh=MeshConfig.from_mapping(sections["mesh"]))


__all__ = ["RunConfig", "SECTIONS", "build"]
