"""The memory settings change memory, never the function: model.remat, train.loss_chunk and
model.seq_chunk against the plain model (loss and every gradient); their config errors;
`main --compile_only` and the fit check that refuses a step too large before any data is made."""

import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first, subprocess_env
from flax import nnx

from efficient_lm import models
from efficient_lm.config.errors import ConfigError
from efficient_lm.models import decoder
from efficient_lm.runtime import exit_codes
from efficient_lm.training import step as train_step
from tests.test_models import tiny_model_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = 32


def batch(vocab: int, B: int = 2, seed: int = 0) -> dict:
  tokens = jax.random.randint(jax.random.key(seed), (B, T + 1), 0, vocab)
  weights = (jax.random.uniform(jax.random.key(seed + 1), (B, T)) > 0.2).astype(jnp.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


def loss_and_grads(cfg, *, loss_chunk: int = 0, params=None):
  """Mean NLL of one batch and its gradient for every parameter (the same init for every cfg),
  and the jaxpr that computed them (text)."""
  model = models.create(cfg, rngs=nnx.Rngs(0))
  graphdef, init = nnx.split(model, nnx.Param)
  params = init if params is None else params
  b = batch(cfg.vocab_size)

  def f(params):
    nll, weight = train_step.model_nll(nnx.merge(graphdef, params), b, loss_chunk=loss_chunk)
    return nll / weight

  jaxpr = str(jax.make_jaxpr(jax.value_and_grad(f))(params))
  value, grads = jax.jit(jax.value_and_grad(f))(params)
  return float(value), grads, params, jaxpr


def assert_same_function(a, b, *, rtol=2e-5, atol=2e-6):
  """Equal loss and gradients, computed two different ways: an equivalence case whose setting
  left the computation unchanged (the same jaxpr) compares a value with itself, and fails."""
  (va, ga, _, ja), (vb, gb, _, jb) = a, b
  assert ja != jb, "both sides ran the same computation: the setting under test did not apply"
  np.testing.assert_allclose(va, vb, rtol=rtol)
  flat_a, flat_b = jax.tree_util.tree_leaves_with_path(ga), jax.tree.leaves(gb)
  assert len(flat_a) == len(flat_b)
  for (path, x), y in zip(flat_a, flat_b):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                               err_msg=jax.tree_util.keystr(path))
  assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(ga))


# Chunks smaller than the hidden state: dense's is T = 32 positions, Perceiver-AR's its 8 latents
# (a chunk of 8 or more would leave its loss whole). A ragged last chunk is padded with weight 0.
@pytest.mark.slow
@pytest.mark.parametrize("name,loss_chunk", [("dense", 12), ("dense", 8), ("perceiver_ar", 3),
                                             ("perceiver_ar", 4)])
def test_chunked_loss_equals_the_whole_loss(name, loss_chunk):
  cfg = tiny_model_config(name, vocab_size=512)
  whole = loss_and_grads(cfg)
  chunked = loss_and_grads(cfg, loss_chunk=loss_chunk, params=whole[2])
  assert chunked[3].count("scan[") > whole[3].count("scan[")  # the loss did run over chunks
  assert_same_function(chunked, whole)


def test_an_equivalence_that_compares_a_value_with_itself_fails():
  """Perceiver-AR's hidden state is its 8 latents: a loss chunk of 8 leaves the loss whole, the
  two sides one computation, which `assert_same_function` refuses (the case it guards against)."""
  cfg = tiny_model_config("perceiver_ar", vocab_size=512)
  whole = loss_and_grads(cfg)
  with pytest.raises(AssertionError, match="the same computation"):
    assert_same_function(loss_and_grads(cfg, loss_chunk=8, params=whole[2]), whole)


@pytest.mark.parametrize("remat", fast_first(["block", "dots"]))
@pytest.mark.parametrize("name", fast_first(["dense", "pi_attention"]))  # scanned / per-layer blocks (doubling)
def test_remat_is_the_same_function(name, remat):
  whole = loss_and_grads(tiny_model_config(name))
  assert_same_function(loss_and_grads(tiny_model_config(name, remat=remat), params=whole[2]), whole)


# Chunks of 8 tokens over T = 32: the windows, skips, blocks and pieces cross chunk borders. BCMT's
# blocks of 8 give a halo of 0 (each chunk computes its own keys); ECP's previous piece is the halo.
# Every registered model of bounded reach (`ModelConfig.chunkable`).
CHUNKABLE = [name for name in sorted(models.REGISTRY) if models.chunkable(tiny_model_config(name))]


@pytest.mark.slow
@pytest.mark.parametrize("name", CHUNKABLE)
def test_sequence_chunks_are_the_same_function(name):
  whole = loss_and_grads(tiny_model_config(name))
  chunked = loss_and_grads(tiny_model_config(name, seq_chunk=8, remat="block"), loss_chunk=16,
                           params=whole[2])
  assert_same_function(chunked, whole)


@pytest.mark.parametrize("name", fast_first(CHUNKABLE, keep=(CHUNKABLE.index("bcmt"),
                                                          CHUNKABLE.index("pi_attention"))))
def test_sequence_chunks_apply_at_a_length_they_do_not_divide(name, caplog):
  """T = 28 with chunks of 8 (evaluation or a prompt at another length): padded to 32 at the end,
  run in chunks, cut back; the logits of the whole pass, by another computation. At T <= the
  chunk the block runs whole, and the log says so once."""
  tokens = jax.random.randint(jax.random.key(2), (2, 28), 0, 64)
  whole = models.create(tiny_model_config(name), rngs=nnx.Rngs(0))
  chunked = models.create(tiny_model_config(name, seq_chunk=8), rngs=nnx.Rngs(0))
  def logits(model):
    graphdef, state = nnx.split(model)
    fn = lambda state, x: nnx.merge(graphdef, state)(x)
    return str(jax.make_jaxpr(fn)(state, tokens)), np.asarray(jax.jit(fn)(state, tokens))

  (chunked_jaxpr, got), (whole_jaxpr, want) = logits(chunked), logits(whole)
  assert chunked_jaxpr != whole_jaxpr  # the chunks did apply
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  caplog.set_level(logging.INFO, logger="efficient_lm.models.decoder")
  decoder._LOGGED.clear()
  short = models.create(tiny_model_config(name, seq_chunk=32), rngs=nnx.Rngs(0))
  short(tokens)
  short(tokens[:, :20])
  said = [r.getMessage() for r in caplog.records if "model.seq_chunk=32" in r.getMessage()]
  assert said == ["model.seq_chunk=32: a sequence of 28 <= 32 tokens is one chunk; the block runs "
                  "on it whole", "model.seq_chunk=32: a sequence of 20 <= 32 tokens is one chunk; "
                  "the block runs on it whole"]


@pytest.mark.slow  # ~20 s a model
@pytest.mark.parametrize("name", ["pi_attention", "bcmt"])
def test_sequence_chunks_leave_dropout_unchanged(name):
  """Dropout masks follow each token's row and absolute position: the chunked block is the same
  function under dropout too (logits equal for one dropout key)."""
  key = jax.random.key(7)
  tokens = jax.random.randint(jax.random.key(1), (2, T), 0, 64)
  out = {}
  for chunk in (0, 8):
    model = models.create(tiny_model_config(name, dropout=0.2, seq_chunk=chunk), rngs=nnx.Rngs(0))
    out[chunk] = np.asarray(model(tokens, dropout_key=key))
  np.testing.assert_allclose(out[8], out[0], rtol=2e-5, atol=2e-6)
  model = models.create(tiny_model_config(name, dropout=0.2), rngs=nnx.Rngs(0))
  assert not np.allclose(np.asarray(model(tokens)), out[0])  # dropout did act


@pytest.mark.slow  # ~20 s: the gradients of every position
def test_sequence_chunks_with_dropout_stay_causal():
  """Chunked blocks with dropout: outputs at t never depend on inputs after t."""
  cfg = tiny_model_config("pi_attention", seq_chunk=8, dropout=0.1)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  x_BTD = model.embed_tokens(jnp.zeros((1, T), jnp.int32) + 3)
  t = 11
  grad = jax.grad(lambda x: jnp.sum(model.from_embeddings(x, dropout_key=jax.random.key(0))[0, t]))(
      x_BTD)
  norms = np.linalg.norm(np.asarray(grad[0]), axis=-1)
  assert np.all(norms[t + 1:] == 0.0) and norms[t] > 0


@pytest.mark.parametrize("name,fields,fix", [
    ("dense", dict(seq_chunk=8), "model.seq_chunk=0"),
    ("perceiver_ar", dict(seq_chunk=8), "model.seq_chunk=0"),
    ("pi_attention", dict(seq_chunk=12), "a divisor of 32"),
    ("bcmt", dict(seq_chunk=4), "a multiple of 8"),
    ("dense", dict(remat="everything"), "'block'"),
    ("pi_attention", dict(seq_chunk=-8), "e.g. 8192"),
])
def test_memory_settings_are_checked(name, fields, fix):
  with pytest.raises(ConfigError, match="model\\.") as e:
    models.validate(tiny_model_config(name, **fields))
  assert fix in str(e.value)


def main_command(config: str, *fields: str) -> list[str]:
  return [sys.executable, "-m", "efficient_lm.main", f"--config={config}",
          "--config.model.d_model=32", "--config.model.num_layers=2", "--config.model.num_heads=2",
          "--config.data.vocab_size=512", "--config.mesh.fsdp=1", *fields]


def run_main(args: list[str], tmp_path) -> subprocess.CompletedProcess:
  env = subprocess_env()  # one device, as a user runs it
  return subprocess.run(args + [f"--workdir={tmp_path / 'w'}", f"--config.data.data_dir={tmp_path / 'd'}"],
                        cwd=REPO, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_compile_only_reports_the_step_and_writes_nothing(tmp_path):
  args = main_command("configs/pi_attention.py", "--config.data.seq_len=256",
                      "--config.data.batch_size=2", "--config.model.remat=block",
                      "--config.model.seq_chunk=64", "--config.train.loss_chunk=64", "--compile_only")
  result = run_main(args, tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.strip().splitlines()
  report = json.loads(lines[-1])
  assert "train step of pi_attention at seq_len 256" in lines[-2]
  for key in ("per_device_argument_bytes", "per_device_output_bytes", "per_device_temp_bytes"):
    assert report[key] > 0
  assert (report["seq_len"], report["batch_size"], report["num_devices"]) == (256, 2, 1)
  assert report["fits"] is True
  assert not (tmp_path / "w").exists() and not (tmp_path / "d").exists()  # no data, no workdir


@pytest.mark.slow
def test_a_step_too_large_is_refused_before_any_data(tmp_path):
  """Dense reference attention at 256K tokens needs terabytes of [T, T] scores: one line, exit 3."""
  args = main_command("configs/dense.py", "--config.model.attention_impl=reference",
                      "--config.data.seq_len=262144", "--config.data.batch_size=8")
  result = run_main(args, tmp_path)
  assert result.returncode == exit_codes.DOES_NOT_FIT, result.stderr[-3000:]
  error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(error) == 1 and "the train step needs" in error[0]
  for field in ("model.attention_impl='xla'", "model.remat", "train.loss_chunk", "data.batch_size",
                "mesh.context"):
    assert field in error[0]
  assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())
