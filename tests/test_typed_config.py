"""The typed model config (issue 50): declared checks, the one edge, and patterns stated without
building the model that equal the built model's."""

import dataclasses
import os
import pkgutil
import re

import pytest
from flax import nnx

from conftest import build, load_config
from efficient_lm.config.data import DataConfig
from efficient_lm import families
from efficient_lm import models
from efficient_lm.config import base as config_base
from efficient_lm.config import fields as tc
from efficient_lm.config import model as model_config
from efficient_lm.config.errors import ConfigError
from efficient_lm.models import decoder
from efficient_lm.models import registry
from efficient_lm.ops import route as route_lib
from tests.test_models import CONFIG_OF, tiny_model_config

REPO = os.path.join(os.path.dirname(__file__), "..")


def typed(section) -> model_config.ModelConfig:
  """A model section (a mapping of its fields) typed through its family's class, as
  `config.run.build` types a config's (the fields it lacks at their defaults, every check run)."""
  name = section["name"]
  return families.CLASSES[name].from_mapping(section, owner=f"model.name={name!r}")


def built_patterns(cfg: model_config.ModelConfig) -> tuple:
  """The patterns read from the built model's modules (shapes only): the old way."""
  model = nnx.eval_shape(lambda: models._build(cfg, nnx.Rngs(0), route_lib.DEFAULT))  # pylint: disable=protected-access
  found = []
  for _, module in model.iter_modules():
    found += [p for p in getattr(module, "patterns", ()) if p not in found]
  return tuple(found)


SETTINGS = [(name, {}) for name in sorted(models.REGISTRY)] + [
    ("pi_attention", dict(period_schedule="constant")),
    ("pi_attention", dict(num_skips=0, num_layers=3)),
    ("pi_attention", dict(window=16, period=4, num_skips=2, num_layers=3)),
    ("bcmt", dict(block_size=4)), ("honly", dict(block_size=32)),
    ("ecp", dict(num_segments=2)), ("ecp", dict(rope_first_layer_only=True)),
    ("perceiver_ar", dict(num_latents=32)), ("double_attention", dict(num_latents=32)),
    ("ssplit_double_attention", dict(num_latents=20, num_history_segments=6)),
    ("compressed_double_attention", dict(num_latents=16, compression=8)),
    ("sliding_window", dict(window=40)),
]


@pytest.mark.parametrize("name,fields", SETTINGS)
def test_stated_patterns_equal_the_built_models(name, fields):
  cfg = tiny_model_config(name, **fields)
  assert cfg.patterns() == built_patterns(cfg)
  assert cfg.patterns(cfg.seq_len) == cfg.patterns()


def test_derived_facts_follow_the_patterns():
  pi = tiny_model_config("pi_attention")
  assert (pi.chunkable, pi.context_block, pi.ring_layout, pi.identical_layers) == (
      True, 1, "natural", False)  # FAMILY_FIELDS: the doubling schedule
  bcmt = tiny_model_config("bcmt", block_size=4)
  assert (bcmt.chunkable, bcmt.context_block, bcmt.ring_layout) == (True, 4, "natural")
  dense = tiny_model_config("dense")
  assert (dense.chunkable, dense.context_block, dense.ring_layout) == (False, 1, "zigzag")
  ssplit = tiny_model_config("ssplit_double_attention", num_latents=8,
                                                 num_history_segments=3)
  assert ssplit.context_block == 8  # the history of 24 in 3 segments


def test_the_message_shape_is_kept():
  with pytest.raises(ConfigError) as error:
    tiny_model_config("dense", d_model=250)
  assert str(error.value) == ("model.d_model=250 must be divisible by model.num_heads=4; set "
                              "model.d_model to a multiple of 4 or change model.num_heads")
  with pytest.raises(ConfigError) as error:
    tiny_model_config("sliding_window", window=0)
  assert str(error.value) == ("model.window=0 must be a positive integer; set model.window to an "
                              "integer >= 1")
  with pytest.raises(ConfigError, match=r"^model\.alpha=1 must be a float in \(0, 1\); set "):
    typed({**dataclasses.asdict(tiny_model_config("bcmt")), "alpha": 1})  # a float only
  with pytest.raises(ConfigError, match=r"^model\.shared_kv=1 must be True or False; set "
                                        r"model\.shared_kv=False \(the default\) or True$"):
    typed({**dataclasses.asdict(tiny_model_config("ecp")), "shared_kv": 1})


@pytest.mark.parametrize("check,good,bad", [
    (tc.positive_int(), [1, 7], [0, -1, 1.0, True, "2"]),
    (tc.non_negative_int(), [0, 3], [-1, 0.0, False]),
    (tc.boolean(), [True, False], [0, 1, "True"]),
    (tc.one_of(("a", "b")), ["a", "b"], ["c", 0, None]),
    (tc.number_in(0.0, 1.0, high_open=True), [0, 0.0, 0.5], [1.0, -0.1, True, "0.5"]),
    (tc.number_in(0.0, 1.0, low_open=True, high_open=True, floats_only=True), [0.5], [0.0, 1, 0]),
])
def test_declared_checks(check, good, bad):
  for value in good:
    check("x.f", value)
  for value in bad:
    with pytest.raises(ConfigError, match=r"^x\.f="):
      check("x.f", value)


def test_a_field_the_family_does_not_declare_is_named():
  config = load_config("dense")
  with config.model.ignore_type():
    config.model.window = 8  # a sliding-window field on the dense model
  with pytest.raises(ConfigError, match=r"^model\.window=8 is not a field of "
                                        r"model\.name='dense'; remove it"):
    build(config)
  config = load_config("dense")
  config.model.name = "gpt5"
  with pytest.raises(ConfigError, match=r"^model\.name='gpt5' is not a known model"):
    build(config)


def test_old_sections_load():
  """A section written before later fields (they take their defaults) and the earlier
  spellings of the backends."""
  cfg = dataclasses.asdict(tiny_model_config("pi_attention"))
  for field in ("gate", "seq_chunk", "remat", "attention_impl", "kernel_interpret"):
    del cfg[field]
  old = typed(cfg | {"attention_impl": "flash"})
  assert (old.gate, old.seq_chunk, old.remat, old.kernel_interpret) == (
      "learned", 0, "none", False)
  models.validate(old, "cpu")
  assert models.attention_backend_name(old, "cpu") == "xla"
  assert models.attention_backend_name(typed(cfg | {"attention_impl": "cudnn"}), "gpu") == "gpu"
  with pytest.raises(ConfigError, match=r"^model\.seq_len=None is missing"):
    typed({k: v for k, v in cfg.items() if k != "seq_len"})


def test_frozen_and_hashable():
  cfg = tiny_model_config("bcmt")
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.block_size = 4  # type: ignore[misc]
  assert hash(cfg) == hash(tiny_model_config("bcmt")) and cfg == tiny_model_config("bcmt")


def test_one_source_for_the_defaults():
  """config_base reads the shared model defaults from ModelConfig; each shipped config's own
  fields (no preset) are its family class's defaults; the remat choices are the decoder's."""
  base = config_base.base_config("dense").model
  assert {k: base[k] for k in model_config.ModelConfig.defaults()} == (
      model_config.ModelConfig.defaults())
  for name, entry in models.REGISTRY.items():
    family, *_ = CONFIG_OF.get(name, (name,))
    section = load_config(family).model
    own = {k: v for k, v in entry.config.defaults().items()
           if k not in model_config.ModelConfig.declared()}
    assert {k: section[k] for k in own} == own, name
  assert set(model_config.REMATS) == {"none", *decoder.REMAT_POLICIES}


def test_the_families_register_themselves():
  """Every config class a module of `efficient_lm.families` defines is declared there and
  registered by its namesake in models/ (each declared model built, nothing else), and
  models.REGISTRY is the registry's table; no module of the families, models or ops reads
  ml_collections."""
  assert models.REGISTRY is registry.REGISTRY
  package = os.path.join(REPO, "efficient_lm", "families")
  classes = set()
  for module in pkgutil.iter_modules([package]):
    mod = __import__(f"efficient_lm.families.{module.name}", fromlist=["_"])
    classes |= {v for v in vars(mod).values() if isinstance(v, type)
                and issubclass(v, model_config.ModelConfig) and v is not model_config.ModelConfig
                and v.__module__ == mod.__name__}
  assert classes == {e.config for e in models.REGISTRY.values()} == set(families.CLASSES.values())
  assert sorted(models.REGISTRY) == sorted(families.CLASSES)
  assert all(e.listing == families.LISTINGS[name] for name, e in models.REGISTRY.items())
  with pytest.raises(ValueError, match="'dense' is registered twice"):
    registry.register("dense", registry.ModelEntry(make_mixer=lambda *a, **k: None))
  with pytest.raises(ValueError, match=r"'other' is not declared in efficient_lm/families/"):
    registry.register("other", registry.ModelEntry(make_mixer=lambda *a, **k: None))
  assert "other" not in models.REGISTRY
  assert models.REGISTRY["dense"].config.__name__ == "DenseConfig"
  for folder in ("families", "models", "ops"):
    for root, _, files in os.walk(os.path.join(REPO, "efficient_lm", folder)):
      for name in files:
        if name.endswith(".py"):
          with open(os.path.join(root, name), encoding="utf-8") as f:
            assert not re.search(r"\bml_collections\b", f.read()), os.path.join(root, name)


def test_help_reads_every_familys_declarations():
  """`--help=<model>` lists exactly the fields the registered model's config class declares
  (its family's, in `efficient_lm.families`, which --help imports without jax), each with the
  class's doc."""
  from efficient_lm.cli import help as help_lib  # pylint: disable=import-outside-toplevel
  for name, entry in models.REGISTRY.items():
    text = " ".join(help_lib.model_listing(name, width=100000).split())
    own = {k: d for k, d in entry.config.docs().items()
           if k not in model_config.ModelConfig.declared()}
    for field, doc in own.items():
      assert f"model.{field}" in text and " ".join(doc.split()) in text, (name, field)


def test_the_train_section_is_typed():
  from efficient_lm.training import prepare as config_check  # pylint: disable=import-outside-toplevel
  from efficient_lm.state import optimizer  # pylint: disable=import-outside-toplevel
  from efficient_lm.config import train as train_config  # pylint: disable=import-outside-toplevel
  assert train_config.SCHEDULES == optimizer.SCHEDULES
  base = config_base.base_config("dense").train
  assert base.to_dict() == train_config.TrainConfig.defaults()
  typed = train_config.TrainConfig.from_mapping(load_config("dense").train)
  assert typed.num_steps == 700 and typed.schedule == "cosine"
  for field, value, message in (
      ("profile_steps", "0:3", r"^train\.profile_steps='0:3' must be '' or 'START:END'"),
      ("seed", 1.5, r"^train\.seed=1\.5 must be an integer; set train\.seed=0$"),
      ("loss_chunk", -1, r"^train\.loss_chunk=-1 must be an integer >= 0 \(0 = the whole "),
      ("num_stepz", 3, r"^train\.num_stepz=3 is not a field of the train section; remove it")):
    config = load_config("dense")
    with config.train.ignore_type():
      config.train[field] = value
    with pytest.raises(ConfigError, match=message):
      config_check.validate(build(config))


def _dicts(section) -> dict:
  """A section's values with nested ConfigDicts (the mesh rules) as plain dicts."""
  return {k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in dict(section).items()}


def test_one_source_for_the_data_and_mesh_defaults():
  from efficient_lm.config import data as data_config, mesh as mesh_config  # pylint: disable=import-outside-toplevel
  base = config_base.base_config("dense")
  assert base.data.to_dict() == data_config.DataConfig.defaults()
  assert base.mesh.to_dict() == _dicts(mesh_config.MeshConfig.defaults())
  assert (base.mesh.fsdp, base.mesh.dcn_data, base.mesh.rules.embed) == (-1, -1, "fsdp")
  # Each factory makes its mapping anew: no section shares (or mutates) another's rules.
  defaults = mesh_config.MeshConfig.defaults
  assert defaults()["rules"] is not defaults()["rules"]


@pytest.mark.parametrize("section,field,value,message", [
    ("data", "seq_len", 0, r"^data\.seq_len=0 must be a positive integer; set data\.seq_len to an "
     r"integer >= 1$"),
    ("data", "archive_sha256", "abc", r"^data\.archive_sha256='abc' must be 64 hex digits or "
     r"empty; "),
    ("data", "test_fraction", 1.0, r"^data\.test_fraction=1\.0 must be a number in \[0, 1\); set "
     r"data\.test_fraction to e\.g\. 0\.05 \(0 = no such split\)$"),
    ("data", "validation_fraction", 0.96, r"^data\.validation_fraction=0\.96 plus "
     r"data\.test_fraction=0\.05 must be below 1"),  # cross-field: DataConfig.check
    ("data", "separator_token", "</s>", r"^data\.separator_token='</s>' only applies to a "
     r"data\.tokenizer of one's own"),
    ("data", "document_mask", 1, r"^data\.document_mask=1 must be True or False; "),
    ("data", "seq_lenn", 64, r"^data\.seq_lenn=64 is not a field of the data section; remove it, "
     r"or use one of its fields: dataset, seq_len, "),
    ("mesh", "fsdp", 0, r"^mesh\.fsdp=0 must be a positive integer or -1 \(the devices the other "
     r"axes leave\); set mesh\.fsdp=1, or -1 on one axis$"),
    ("mesh", "tensor", -1, r"^mesh\.tensor=-1 is not the only axis at -1 \(mesh\.fsdp, "
     r"mesh\.tensor\)"),  # cross-field: MeshConfig.check (the tests' configs pin fsdp=1)
    ("mesh", "dcn_fsdp", -1, r"^mesh\.dcn_fsdp=-1 and mesh\.dcn_data=-1 cannot both take the rest"),
    ("mesh", "max_replicated_fraction", 2.0, r"^mesh\.max_replicated_fraction=2\.0 must be in "
     r"\[0, 1\]"),
    ("mesh", "shard_optimizer_over_data", 1, r"^mesh\.shard_optimizer_over_data=1 must be True or "
     r"False"),
    ("mesh", "rules", {"embed": "fsd"}, r"^mesh\.rules\.embed='fsd' names an axis the mesh does "
     r"not have"),
    ("mesh", "activation_rules", {"batch": "data"}, r"^mesh\.activation_rules\.batch='data' is "
     r"where the input batch is placed"),
    ("mesh", "tensr", 2, r"^mesh\.tensr=2 is not a field of the mesh section; remove it"),
])
def test_the_data_and_mesh_checks_fire_before_anything_runs(section, field, value, message):
  """Through the one edge: `config_check.validate` builds the typed sections and names the field
  (the model is never built: these fail before the parameters' shapes are traced)."""
  from efficient_lm.training import prepare as config_check  # pylint: disable=import-outside-toplevel
  config = load_config("dense")
  with config[section].ignore_type():
    config[section][field] = value
    if (section, field) == ("mesh", "tensor"):
      config.mesh.fsdp = -1
  with pytest.raises(ConfigError, match=message):
    config_check.validate(build(config))


def test_a_partial_mesh_section_takes_the_class_defaults():
  """A mesh section that lacks a field (a hand-written one, an old config.json) reads
  `MeshConfig`'s default: `fsdp=-1` takes every device the others leave (`sharding` used to
  read 1 for a missing axis, unlike config_base's -1)."""
  from efficient_lm.config.mesh import MeshConfig  # pylint: disable=import-outside-toplevel
  from efficient_lm.parallel import sharding  # pylint: disable=import-outside-toplevel
  assert sharding.mesh_sizes(MeshConfig.from_mapping(dict(data=2)), num_devices=8) == dict(
      data=2, fsdp=4, tensor=1, context=1)
  assert sharding.dcn_sizes(MeshConfig.from_mapping({}), slices=4) == {"data": 4, "fsdp": 1}
  # every model's axes at their defaults, BCMT's memory too
  rules = sharding.parse_rules(MeshConfig.from_mapping({}))
  assert rules["embed"] == ("fsdp",) and rules["memory"] == ("fsdp",)
  with pytest.raises(ConfigError, match=r"^mesh\.fsdp=-1 is not the only axis at -1 "
                                        r"\(mesh\.data, mesh\.fsdp\)"):
    MeshConfig.from_mapping({"data": -1})  # the default fsdp=-1 counts


def test_old_config_json_data_and_mesh_sections_load():
  """A run's config.json written before later data / mesh fields: they are filled (a
  `BEFORE_FIELD` one with the value the run trained with) and the typed sections build."""
  from efficient_lm.config import data as data_config, mesh as mesh_config  # pylint: disable=import-outside-toplevel
  config = load_config("dense")
  with config.unlocked():
    for section, field in (("data", "document_mask"), ("data", "tokenizer"),
                           ("data", "hf_allow_download"), ("mesh", "activation_rules"),
                           ("mesh", "max_replicated_fraction"), ("mesh", "dcn_fsdp")):
      del config[section][field]
  config_base.fill_defaults(config, saved=True)
  data = data_config.DataConfig.from_mapping(config.data)
  mesh = mesh_config.MeshConfig.from_mapping(config.mesh)
  assert (data.document_mask, data.tokenizer, data.hf_allow_download) == (False, "", False)
  assert (mesh.max_replicated_fraction, mesh.dcn_fsdp) == (0.05, 1)
  assert mesh.activation_axes["mlp"] == ("tensor",)


@pytest.mark.parametrize("name,overrides,message", [
    ("dense", dict(d_model=30, num_heads=6), r"^model\.d_model=30 gives an odd head width 5, "
     r"which RoPE cannot rotate; make model\.d_model / model\.num_heads even$"),
    ("dense", dict(attention_impl="pallas"), r"^model\.attention_impl='pallas' is not a known "
     r"attention backend; use one of auto, xla, splash, gpu, reference$"),
    ("dense", dict(seq_chunk=8), r"^model\.seq_chunk=8 is not supported for model\.name='dense': "
     r"its queries see the whole window"),
    ("sliding_window", dict(seq_chunk=12), r"^model\.seq_chunk=12 must divide data\.seq_len=32; "
     r"set model\.seq_chunk to a divisor of 32$"),
    ("bcmt", dict(seq_chunk=4), r"^model\.seq_chunk=4 is not a multiple of bcmt's attention block "
     r"of 8 tokens \(a chunk holds whole blocks\); set model\.seq_chunk to a multiple of 8$"),
    ("bcmt", dict(block_size=12), r"^model\.block_size=12 must divide data\.seq_len=32; use a "
     r"divisor of 32 such as 4, 8 or 16, or change data\.seq_len$"),
    ("ecp", dict(num_segments=5), r"^model\.num_segments=5 must divide model\.seq_len=32; set "
     r"model\.num_segments to a divisor of 32, e\.g\. 2 or 4$"),
    ("perceiver_ar", dict(num_latents=40), r"^model\.num_latents=40 must be at most "
     r"model\.seq_len=32; set model\.num_latents to at most 32, e\.g\. 16$"),
    ("compressed_double_attention", dict(compression=5), r"^model\.compression=5 must divide the "
     r"history length model\.seq_len - model\.num_latents = 24; set model\.compression to a "
     r"divisor of 24, e\.g\. 4$"),
    ("ssplit_double_attention", dict(num_history_segments=5), r"^model\.num_history_segments=5 "
     r"must divide the history length model\.seq_len - model\.num_latents = 24; set "
     r"model\.num_history_segments to a divisor of 24, e\.g\. 4$"),
])
def test_each_declared_model_rule_names_its_field(name, overrides, message):
  """The shared and the families' cross-field rules (`RULES`) fire with their message."""
  with pytest.raises(ConfigError, match=message):
    tiny_model_config(name, **overrides)


def test_a_rule_applies_only_when_its_variant_reads_the_field():
  # perceiver_ar never compresses: a compression not dividing the history is not its concern.
  assert tiny_model_config("perceiver_ar", compression=5).compression == 5


@pytest.mark.parametrize("section,mapping,message", [
    ("mesh", dict(rules={"layers": "fsdp"}), r"^mesh\.rules\.layers='fsdp' must be '': the "
     r"stacked layers of nnx\.scan are never sharded; set mesh\.rules\.layers=''$"),
    ("mesh", dict(rules={"embed": 3}), r"^mesh\.rules\.embed=3 must be a string; set "
     r"mesh\.rules\.embed to a mesh axis"),
    ("mesh", dict(activation_rules={"emb": "fsdp"}), r"^mesh\.activation_rules\.emb='fsdp' is not "
     r"an activation axis; use one of embed, heads, kv, kv_heads, mlp, vocab$"),
    ("mesh", dict(activation_rules={"mlp": "tensr"}), r"^mesh\.activation_rules\.mlp='tensr' "
     r"names an axis the mesh does not have"),
    ("train", dict(wandb="yes"), r"^train\.wandb='yes' must be True or False; set "
     r"train\.wandb=True to log to W&B, or False$"),
    ("train", dict(wandb_project=" "), r"^train\.wandb_project=' ' must be a non-empty string; set "
     r"train\.wandb_project=efficient_lm$"),
    ("train", dict(wandb_run_name=None), r"^train\.wandb_run_name=None must be a string; set "
     r"train\.wandb_run_name='' \(or e\.g\. 'a,b' for tags\)$"),
])
def test_each_moved_section_check_keeps_its_message(section, mapping, message):
  from efficient_lm.config import mesh as mesh_config, train as train_config  # pylint: disable=import-outside-toplevel
  cls = {"mesh": mesh_config.MeshConfig, "train": train_config.TrainConfig}[section]
  with pytest.raises(ConfigError, match=message):
    cls.from_mapping(mapping)


def test_rules_are_stated_for_help():
  """Every section's cross-field rules are declared, so `--help` can state them."""
  from efficient_lm.config import data as data_config, mesh as mesh_config  # pylint: disable=import-outside-toplevel
  stated = [r.describe() for r in models.REGISTRY["bcmt"].config.all_rules()]
  assert "model.d_model must be divisible by model.num_heads={num_heads}" in stated
  assert "model.block_size must divide data.seq_len={seq_len}" in stated
  assert len(data_config.DataConfig.all_rules()) == 2
  assert len(mesh_config.MeshConfig.all_rules()) == 2


def test_the_declared_attention_backends_are_the_cores():
  from efficient_lm.ops.core import backends  # pylint: disable=import-outside-toplevel
  assert model_config.ATTENTION_IMPLS == backends.IMPLS
  assert model_config.ATTENTION_ALIASES == tuple(backends.ALIASES)
