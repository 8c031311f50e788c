"""docs/adding_a_model.md runs as written: its four files (the family's config module, which
declares its models, the mixer's module, which registers itself, a config, and its settings for
the shared tests), none of them shared, make a family that `--help` lists and that passes the
model tests, with documents, the kernels and context parallelism.

The code blocks are read from the page (`<!-- file: PATH -->` markers), the modules imported from
scratch files (declaring and registering the family for the test: the families' tables and the
registry are restored after it), and nothing else in the library is changed.
"""

import importlib.util
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import build
from efficient_lm import families
from efficient_lm import models
from efficient_lm.config.errors import ConfigError
from efficient_lm.training import prepare as config_check
import test_documents
import test_kernel_models
import test_ring

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "adding_a_model.md")
NAME = "dilated_window"


def blocks() -> dict[str, str]:
  """{marker: the python block after it} of the page."""
  with open(DOC, encoding="utf-8") as f:
    text = f.read()
  found = re.findall(r"<!-- (file: [^ ]+) -->\n```python\n(.*?)```", text, re.S)
  return {marker: code for marker, code in found}


@pytest.fixture
def example(tmp_path, monkeypatch):
  """The page's family, registered: (its module, its config module, its test settings)."""
  code = blocks()
  files = {marker.removeprefix("file: ") for marker in code}
  # Four files, no shared one: the family's config, its mixer, the config file and its test
  # settings.
  assert files == {f"efficient_lm/families/{NAME}.py", f"efficient_lm/models/{NAME}.py",
                   f"configs/{NAME}.py", f"tests/families/{NAME}.py"}
  for path in files:  # none of them exists: each is the family's own
    assert not os.path.exists(os.path.join(os.path.dirname(DOC), "..", path)), path
  saved = dict(models.REGISTRY)
  monkeypatch.setattr(families, "CLASSES", dict(families.CLASSES))
  monkeypatch.setattr(families, "LISTINGS", dict(families.LISTINGS))
  modules = {}
  order = sorted(files, key=lambda p: not p.startswith("efficient_lm/families/"))  # declared first
  for path in order:
    local = tmp_path / os.path.basename(path)
    local.write_text(code[f"file: {path}"], encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"scratch_{local.stem}_{path.split('/')[0]}",
                                                  local)
    modules[path] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(modules[path])
    if path.startswith("efficient_lm/families/"):  # as `efficient_lm.families` imports it
      monkeypatch.setitem(sys.modules, f"efficient_lm.families.{NAME}", modules[path])
      families.declare(modules[path])
  family = modules[f"efficient_lm/families/{NAME}.py"]
  mixer = modules[f"efficient_lm/models/{NAME}.py"]
  monkeypatch.setitem(sys.modules, f"efficient_lm.models.{NAME}", mixer)
  assert models.REGISTRY[NAME].config is family.DilatedWindowConfig  # it registered itself
  settings = modules[f"tests/families/{NAME}.py"]
  assert set(settings.FIELDS) == {NAME} and set(settings.TASKS) == {NAME}
  config_module = modules[f"configs/{NAME}.py"]
  config_module.FIELDS = settings.FIELDS[NAME]  # what `tiny` builds it with
  yield mixer, config_module
  models.REGISTRY.clear()
  models.REGISTRY.update(saved)


def tiny(config_module, **overrides):
  """The page's config at the tiny test sizes (the model section, or the whole config)."""
  config = config_module.get_config()
  config.data.update(seq_len=32, batch_size=2, vocab_size=300)
  config.model.update({**dict(d_model=32, num_layers=2, num_heads=4, mlp_ratio=2),
                        **config_module.FIELDS, **overrides})
  return config


def test_help_lists_it_from_its_declaration(example):
  """`--help`'s model list and `--help=<model>` read the family's declaration (its `MODELS`, its
  class's fields), which the registry took too."""
  from efficient_lm.cli import help as help_lib  # pylint: disable=import-outside-toplevel
  assert help_lib.listed_models()[NAME] == models.REGISTRY[NAME].listing == (
      NAME, "a window of model.window keys, model.dilation apart")
  assert help_lib.declared_meanings(NAME)["model.dilation"] == (
      "(int) distance between two keys a query sees")


def test_the_config_validates_and_a_bad_field_is_named(example):
  _, config_module = example
  config_check.validate(build(config_module.get_config()))
  with pytest.raises(ConfigError, match=r"model\.dilation"):
    config_check.validate(build(tiny(config_module, dilation=0)))


def test_causal_through_gradients(example):
  _, config_module = example
  cfg = build(tiny(config_module)).model
  model = models.create(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (1, 32), 0, cfg.vocab_size)
  graphdef, params = nnx.split(model)
  grad = jax.jit(lambda p, x, t: jax.grad(
      lambda x, p: jnp.sum(nnx.merge(graphdef, p).from_embeddings(x)[0, t]), argnums=(0, 1))(x, p)[0])
  x = model.embed_tokens(tokens)
  for t in (0, 9, 31):
    norms = np.linalg.norm(np.asarray(grad(params, x, t)[0]), axis=-1)
    assert np.all(norms[t + 1:] == 0.0) and norms[t] > 0
    # Only its own keys: t, t - 4, t - 8 (a window of 3 keys, 4 apart) in the first layer, and
    # what those saw in the second; never an odd distance.
    assert np.all(norms[:t + 1][(t - np.arange(t + 1)) % 4 != 0] == 0.0)


def test_decoding_and_documents(example):
  """Cached decoding with three documents equals the full pass; documents never leak, whole, in
  sequence chunks and with the sequence over two devices."""
  _, config_module = example
  cfg = build(tiny(config_module)).model
  model = models.create(cfg, rngs=nnx.Rngs(0))
  N, P = 32, 20
  tokens = jax.random.randint(jax.random.key(3), (2, N), 0, cfg.vocab_size)
  ids = jnp.asarray(test_documents.random_documents(2, N, seed=12, count=4))
  graphdef, state = nnx.split(model)
  full = jax.jit(lambda s, t, i: nnx.merge(graphdef, s)(t, segment_ids_BT=i))(state, tokens, ids)
  logits, cache = jax.jit(lambda s, t, i: nnx.merge(graphdef, s).prefill(
      t, nnx.merge(graphdef, s).init_cache(2, N), i))(state, tokens[:, :P], ids[:, :P])
  step = jax.jit(lambda s, t, c, p, i: nnx.merge(graphdef, s).decode_step(t, c, p, i))
  outs = [logits[:, -1]]
  for p in range(P, N - 1):
    out, cache = step(state, tokens[:, p], cache, p, ids[:, p])
    outs.append(out)
  np.testing.assert_allclose(jnp.stack(outs, axis=1), full[:, P - 1:N - 1], atol=1e-4)
  assert cache[0]["k"].shape[1] == 2 * 4 + 1  # the span: (window - 1) * dilation + 1 keys
  for chunk_cfg, mesh in ((cfg, None), (build(tiny(config_module, seq_chunk=16)).model, None),
                          (cfg, test_documents.mesh_of(1, 2))):
    got, got_other = test_documents.perturbed_logits(chunk_cfg, mesh=mesh, cut=19)
    assert float(jnp.max(jnp.abs(got - got_other))) <= 1e-5


@pytest.mark.parametrize("impl", ["splash", "gpu"])
def test_the_kernels_compute_what_xla_does(example, impl):
  _, config_module = example
  tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 64)
  cfg = lambda **kw: build(tiny(config_module, **kw)).model
  want_loss, want = test_kernel_models.loss_and_grads(cfg(seq_chunk=16), tokens)
  got_loss, got = test_kernel_models.loss_and_grads(
      cfg(seq_chunk=16, attention_impl=impl, kernel_interpret=True), tokens)
  np.testing.assert_allclose(got_loss, want_loss, rtol=2e-5)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-4)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_context_parallel_training_matches_one_device(example):
  _, config_module = example
  config = tiny(config_module)
  config.model.update(d_model=16, num_heads=2)
  one = test_ring.train_losses(config, test_ring.mesh_of(1, 1))
  parallel = test_ring.train_losses(config, test_ring.mesh_of(1, 4))
  assert one[-1] < one[0]
  np.testing.assert_allclose(parallel, one, rtol=2e-5)
