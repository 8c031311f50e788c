"""The edge (issue 50): the config typed once and its facts computed once, then handed down; the
rules that join a section to its surroundings declared (`ModelPlacement`, `MeshOnDevices`,
`DataSource`) and their messages."""

import dataclasses

import jax
import pytest

from conftest import build, load_config
from efficient_lm import data
from efficient_lm import models
from efficient_lm.config import mesh as mesh_config
from efficient_lm.config.run import RunConfig
from efficient_lm.config.errors import ConfigError
from efficient_lm.data import config as data_config_lib
from efficient_lm.data import tokenizer as tok
from efficient_lm.models import placement
from efficient_lm.state import train_state
from efficient_lm.training import prepare as config_check


def tiny(name: str = "pi_attention"):
  config = load_config(name)
  config.model.update(d_model=32, num_layers=1, num_heads=2)
  config.data.update(seq_len=64, batch_size=2)
  return config


def test_prepare_builds_the_model_once_and_hands_on_its_facts(monkeypatch):
  """The edge builds the model once (from shapes) and the abstract train state from it; the real
  state is the one other build. The batch's layout and document ids come with the state."""
  builds = []
  create = models.create
  monkeypatch.setattr(models, "create", lambda *a, **k: builds.append(a[0]) or create(*a, **k))
  config = tiny()
  typed, built = config_check.prepare(build(config), jax.devices()[:1])
  assert len(builds) == 1 and builds[0] is typed.model
  assert isinstance(typed, RunConfig) and typed.model.d_model == 32
  assert (built.layout, built.document_ids) == ("natural", True)
  assert built.num_params == train_state.build(build(config), built.mesh, abstract=True).num_params
  builds.clear()
  state = train_state.initialize(typed, built)
  assert len(builds) == 1
  assert jax.tree.map(lambda x: x.shape, state) == jax.tree.map(lambda x: x.shape, built.state)
  generated = tiny()
  generated.data.update(dataset="mqar:seq_len=64,latents=16,queries=2,pairs=6,min_distance=6,"
                        "keys=16,values=16,filler=16,eval_sequences=24", vocab_size=64)
  assert not config_check.prepare(build(generated), jax.devices()[:1])[1].document_ids


def test_the_edge_sets_a_given_tokenizers_vocabulary_on_the_model(tmp_path, monkeypatch):
  """A `data.tokenizer` sets `data.vocab_size` at the edge; the typed model follows, and so does
  the ConfigDict (what config.json records)."""
  class Given:
    vocab_size = 300
  path = tmp_path / "spm.model"
  path.write_bytes(b"x")
  monkeypatch.setattr(tok, "open_given", lambda _: Given())
  config = tiny()
  config.data.tokenizer = str(path)
  typed, built = config_check.prepare(build(config), jax.devices()[:1])
  # the run as it trains is a new RunConfig (`with_vocab`): the config it came from is unchanged
  assert typed.data.vocab_size == typed.model.vocab_size == 300 != config.model.vocab_size
  embed = [x for p, x in jax.tree_util.tree_leaves_with_path(built.state.params)
           if "embed" in jax.tree_util.keystr(p)]
  assert any(300 in x.shape for x in embed)


def test_the_data_layer_takes_the_typed_section_never_the_mapping(tmp_path):
  """A typed section is read by attribute only (no mapping reading); the data functions take it,
  and refuse the ConfigDict section (its caller types it first: `data.validate`)."""
  config = tiny()
  config.data.data_dir = str(tmp_path / "never")
  typed = data.validate(build(config).data)
  assert typed == build(config).data and typed.seq_len == 64
  with pytest.raises(TypeError):
    typed["seq_len"]  # pylint: disable=pointless-statement
  assert not hasattr(typed, "get")
  with pytest.raises(TypeError):
    "tokenizer" in typed  # pylint: disable=pointless-statement
  assert data.known_splits(typed) == ("train", "validation", "test", "test_milton")
  assert data.has_document_ids(typed) and not data.has_document_ids(
      dataclasses.replace(typed, document_mask=False))
  refused = r"takes the typed data section \(a RunConfig's data: config\.run\.build\(\.\.\.\)" \
            r"\.data\), not ConfigDict$"
  for call in (data.validate, data.known_splits, data.has_document_ids, data.preflight, data.load):
    with pytest.raises(TypeError, match=rf"^data\.{call.__name__} {refused}"):
      call(config.data)
  assert not (tmp_path / "never").exists()  # refused before anything is prepared


@pytest.mark.parametrize("overrides, context, platform, message", [
    (dict(attention_impl="splash"), 1, "cpu", "model.attention_impl='splash' cannot run here: "),
    (dict(seq_chunk=8), 2, None, "model.seq_chunk=8 is not combined with mesh.context=2 (the ring "
     "ops already split the sequence over devices); set model.seq_chunk=0, or mesh.context=1"),
    (dict(name="bcmt", block_size=16), 8, None, "mesh.context=8 leaves 8 tokens per device, not a "
     "multiple of bcmt's attention block of 16 tokens (blocks may not straddle devices)"),
])
def test_model_placement_rules_name_the_field(overrides, context, platform, message):
  config = tiny(overrides.pop("name", "pi_attention"))
  config.model.update(overrides)
  cfg = build(config).model
  with pytest.raises(ConfigError) as error:
    placement.ModelPlacement(model=cfg, platform=platform, context=context)
  assert str(error.value).startswith(message), str(error.value)
  assert len(str(error.value).splitlines()) == 1
  placement.ModelPlacement(model=build(tiny()).model, platform="cpu", context=1)


def test_perceiver_ar_has_no_ring():
  config = tiny("perceiver_ar")
  config.model.num_latents = 16
  cfg = build(config).model
  with pytest.raises(ConfigError, match=r"^mesh.context=2 > 1 is not supported for "
                     r"model.name='perceiver_ar' \(.*\); set mesh.context=1 .* or use one of "):
    placement.check(cfg, None, 2)


@pytest.mark.parametrize("sizes, grad_accum, message", [
    (dict(data=1, fsdp=4, tensor=1, context=1), 1, "data.batch_size=6 must be divisible by the "
     "mesh's batch axes (data=1 x fsdp=4); set data.batch_size to a multiple of 4, or lower "
     "mesh.data / mesh.fsdp"),
    (dict(data=1, fsdp=2, tensor=1, context=1), 2, "data.batch_size=6 must be divisible by the "
     "mesh's batch axes (data=1 x fsdp=2) times train.grad_accum_steps=2; set data.batch_size to "
     "a multiple of 4, or lower mesh.data / mesh.fsdp / train.grad_accum_steps"),
    (dict(data=1, fsdp=1, tensor=1, context=5), 1, "mesh.context=5 must divide data.seq_len=32"),
])
def test_mesh_on_devices_rules(sizes, grad_accum, message):
  with pytest.raises(ConfigError) as error:
    mesh_config.MeshOnDevices(sizes=sizes, seq_len=32, batch_size=6, grad_accum_steps=grad_accum)
  assert str(error.value).startswith(message), str(error.value)
  mesh_config.MeshOnDevices(sizes=sizes | {"context": 1}, seq_len=32, batch_size=8)


@pytest.mark.parametrize("fields, message", [
    (dict(dataset="shakespear"), "data.dataset='shakespear' is not a known dataset; use one of "),
    (dict(dataset="mqar:num_pairs=4", tokenizer="t.model"), "data.tokenizer='t.model' does not "
     "apply to the generated dataset 'mqar:num_pairs=4' (it has its own ids); set data.tokenizer "
     "to ''"),
    (dict(archive="a.zip", dataset="tfds:lm1b"), "data.archive='a.zip' is only used by the "),
])
def test_data_source_rules_run_in_order(fields, message):
  typed = dataclasses.replace(build(tiny()).data, **fields)
  with pytest.raises(ConfigError) as error:
    data_config_lib.DataSource(data=typed, source=data.registry.lookup(typed.dataset))
  assert str(error.value).startswith(message), str(error.value)


def test_python_callers_train_through_the_one_edge(tmp_path, monkeypatch):
  """`efficient_lm.train(config, workdir)`: a config file's ConfigDict typed once
  (`config.run.build`) and checked as the command checks it (the workdir's checks, then `prepare`)
  before anything compiles; what `prepare` returned is what trains."""
  import efficient_lm  # pylint: disable=import-outside-toplevel
  from efficient_lm.state import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  from efficient_lm.training import loop  # pylint: disable=import-outside-toplevel
  trained, prepared = [], []
  monkeypatch.setattr(loop, "train_and_evaluate",
                      lambda run, workdir, built: trained.append((run, workdir, built)) or {"step": 1})
  real_prepare = config_check.prepare
  monkeypatch.setattr(config_check, "prepare",
                      lambda run, devices=None: prepared.append(run) or real_prepare(run, devices))
  unknown = tiny()
  unknown.model.name = "no_such_model"
  with pytest.raises(ConfigError, match=r"model.name='no_such_model' is not a known model"):
    efficient_lm.train(unknown, str(tmp_path / "run"))
  (tmp_path / "a_file").write_text("x")
  with pytest.raises(workdir_lib.WorkdirError, match=r"--workdir=.*a_file.* not a folder"):
    efficient_lm.train(tiny(), str(tmp_path / "a_file"))
  assert not prepared and not trained  # refused before the devices, the data or any compile
  config = tiny()
  config.mesh.update(data=1, fsdp=1, tensor=1, context=1)
  assert efficient_lm.train(config, str(tmp_path / "run")) == {"step": 1}
  (run, workdir, built), = trained
  assert len(prepared) == 1 and isinstance(prepared[0], RunConfig) and prepared[0].model.d_model == 32
  assert isinstance(run, RunConfig) and workdir == str(tmp_path / "run") and built.num_params > 0
  efficient_lm.train(prepared[0], str(tmp_path / "run"))  # a RunConfig as it is
  assert prepared[1] is prepared[0]
