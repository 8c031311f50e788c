"""BCMT and HOnly: causality at block boundaries, streaming decoding, config checks, training."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import build, fast_first, load_config
from efficient_lm import models
from efficient_lm.config.errors import ConfigError
from efficient_lm.models import bcmt
from efficient_lm.models import decoder
from efficient_lm.models import layers
from test_models import tiny_model_config

L = 8  # block size of the tiny models: seq_len 32 is 4 blocks


BOUNDARIES = (L - 1, L, 2 * L - 1, 2 * L, 3 * L, 4 * L - 1)  # last and first tokens of blocks


@functools.lru_cache(maxsize=None)
def grads_of_output(name, ts=BOUNDARIES):
  """{t: |d logits[t] / d x[s]| over s} for a tiny model with blocks of L (computed once per model)."""
  cfg = tiny_model_config(name, block_size=L)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (1, cfg.seq_len), 0, cfg.vocab_size)
  x_BTD = model.embed_tokens(tokens)
  graphdef, params = nnx.split(model)

  @jax.jit
  def grad_norms(params, x_BTD, t):
    out = lambda x, p: jnp.sum(nnx.merge(graphdef, p).from_embeddings(x)[0, t])
    return jnp.linalg.norm(jax.grad(out, argnums=(0, 1))(x_BTD, params)[0][0], axis=-1)

  return {t: np.asarray(grad_norms(params, x_BTD, t)) for t in ts}


@pytest.mark.parametrize("name", fast_first(["bcmt", "honly"], keep=(1,)))
def test_causal_at_block_boundaries(name):
  """No output depends on a later token, in particular not the last token of a block on the next."""
  for t, norms in grads_of_output(name).items():
    assert np.all(norms[t + 1:] == 0.0), f"{name}: output {t} depends on {np.nonzero(norms[t + 1:])[0] + t + 1}"
    assert norms[t] > 0.0


def test_memory_reaches_earlier_blocks_and_honly_does_not():
  """BCMT's first token of block b sees every earlier block through the memory; HOnly sees only itself."""
  bcmt, honly = grads_of_output("bcmt"), grads_of_output("honly")
  for t in (L, 3 * L):
    assert np.all(bcmt[t][:t] > 0.0), f"bcmt: output {t} misses {np.nonzero(bcmt[t][:t] == 0)[0]}"
    assert np.all(honly[t][:t] == 0.0)


def decode_all(model, tokens_BT):
  graphdef, params = nnx.split(model)

  @jax.jit
  def step(params, tokens_B, cache, position):
    return nnx.merge(graphdef, params).decode_step(tokens_B, cache, position)

  cache = model.init_cache(*tokens_BT.shape)
  shapes = jax.tree.map(jnp.shape, cache)
  logits = []
  for t in range(tokens_BT.shape[1]):
    logits_BV, cache = step(params, tokens_BT[:, t], cache, t)
    logits.append(logits_BV)
  assert jax.tree.map(jnp.shape, cache) == shapes  # the state does not grow with the length
  return jnp.stack(logits, axis=1)


@pytest.mark.parametrize("name,position,scanned", fast_first([
    ("bcmt", "rope", True), ("bcmt", "learned", False), ("honly", "rope", True)], keep=(0, 2)))
def test_streaming_decoding_equals_forward(name, position, scanned):
  """Token-by-token logits equal the full pass's at every position: 4 blocks and a ragged fifth."""
  cfg = tiny_model_config(name, block_size=L, position=position, seq_len=40)
  entry = models.REGISTRY[name]
  model = decoder.Decoder(cfg, lambda layer, rngs: entry.make_mixer(cfg, layer, rngs),
                          identical_layers=scanned, rngs=nnx.Rngs(0))
  tokens_BT = jax.random.randint(jax.random.key(2), (2, 4 * L + 3), 0, cfg.vocab_size)
  full_BTV = jax.jit(lambda m, x: m(x))(model, tokens_BT)
  np.testing.assert_allclose(decode_all(model, tokens_BT), full_BTV, atol=2e-5, rtol=2e-5)


def test_memory_changes_the_logits():
  """Guards the decoding test: with the memory's projection zeroed, logits after block 0 change."""
  cfg = tiny_model_config("bcmt", block_size=L)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  tokens_BT = jax.random.randint(jax.random.key(2), (1, cfg.seq_len), 0, cfg.vocab_size)
  before = model(tokens_BT)
  model.blocks.mixer.memory_proj.kernel[...] = jnp.zeros_like(model.blocks.mixer.memory_proj.kernel[...])
  after = model(tokens_BT)
  np.testing.assert_allclose(before[:, :L], after[:, :L], atol=1e-6)
  assert np.abs(before[:, L:] - after[:, L:]).max() > 1e-3


@pytest.mark.parametrize("name,overrides,field", [
    ("bcmt", dict(block_size=12), "model.block_size"),
    ("bcmt", dict(block_size=0), "model.block_size"),
    ("honly", dict(block_size=64), "model.block_size"),
    ("bcmt", dict(alpha=1.0), "model.alpha"),
    ("bcmt", dict(alpha=0.0), "model.alpha"),
])
def test_validation_names_the_field(name, overrides, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as error:
    models.validate(tiny_model_config(name, **overrides))
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("preset,name,block", [
    (None, "bcmt", 256), ("64", "bcmt", 64), ("128", "bcmt", 128), ("256", "bcmt", 256),
    ("512", "bcmt", 512), ("honly", "honly", 256), ("honly128", "honly", 128)])
def test_presets(preset, name, block):
  config = load_config("bcmt", preset)
  assert (config.model.name, config.model.block_size) == (name, block)
  assert config.data.seq_len * config.data.batch_size == load_config("dense").data.seq_len * 8
  models.validate(build(config).model)


def test_unknown_preset_is_refused():
  with pytest.raises(ValueError, match="honly128"):
    load_config("bcmt", "100")


def plain_bcmt_mixer(p, x_BTD, *, num_heads, block_size, alpha, rope_base):
  """BCMT's five steps written out plainly from the mixer's parameters `p` (a nested dict):
  dense masked block-local attention, pool, memory (a double sum), project, shift, gate."""
  B, T, D = x_BTD.shape
  L, N, H = block_size, T // block_size, num_heads
  qkv = jnp.einsum("btd,dchk->btchk", x_BTD, p["attn"]["qkv"]["kernel"])  # [B, T, 3, H, K]
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  q, k = (layers.rope(qkv[:, :, i], positions, rope_base) for i in range(2))
  v = qkv[:, :, 2]
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  allowed = (j <= i) & (j // L == i // L)
  logits = jnp.einsum("bihk,bjhk->bhij", q, k) / np.sqrt(D // H)
  probs = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)
  h = jnp.einsum("bhij,bjhk->bihk", probs, v).reshape(B, T, D) @ p["attn"]["out"]["kernel"]
  # 1. pool: softmax over each block's tokens of h . w_pool, then the weighted sum.
  h_BNLD = h.reshape(B, N, L, D)
  a = jax.nn.softmax(jnp.einsum("bnld,do->bnl", h_BNLD, p["pool"]["kernel"]), axis=-1)
  s = jnp.einsum("bnl,bnld->bnd", a, h_BNLD)
  # 2. memory: m[b] = sum_{c<=b} alpha^(b-c) s[c] / sum_{c<=b} alpha^(b-c).
  m = jnp.stack([sum(alpha ** (b - c) * s[:, c] for c in range(b + 1))
                 / sum(alpha ** (b - c) for c in range(b + 1)) for b in range(N)], axis=1)
  # 3. project, 4. shift by one block (block 0 gets zeros).
  proj = m @ p["memory_proj"]["kernel"]
  shifted = jnp.concatenate([jnp.zeros_like(proj[:, :1]), proj[:, :-1]], axis=1)
  p_BTD = jnp.repeat(shifted, L, axis=1)
  # 5. gate: out = h + sigmoid(W_g [h; p] + b_g) * p.
  g = jax.nn.sigmoid(h @ p["gate_h"]["kernel"] + p["gate_h"]["bias"] + p_BTD @ p["gate_p"]["kernel"])
  return h + g * p_BTD


@pytest.mark.slow
def test_mixer_equals_its_five_steps_written_plainly():
  """The BCMT mixer against the plain reference, value and every gradient, on random weights."""
  cfg = tiny_model_config("bcmt", block_size=L, alpha=0.7)
  mixer = bcmt.make_mixer(cfg, 0, nnx.Rngs(5))
  graphdef, state = nnx.split(mixer)
  # Random weights everywhere (the initializers leave biases at zero).
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(6), len(leaves))
  state = jax.tree.unflatten(treedef, [0.3 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
  x_BTD = jax.random.normal(jax.random.key(7), (2, cfg.seq_len, cfg.d_model))
  positions = jnp.broadcast_to(jnp.arange(cfg.seq_len), (2, cfg.seq_len))
  cot = jax.random.normal(jax.random.key(8), x_BTD.shape)

  fast = lambda s, x: jnp.sum(cot * nnx.merge(graphdef, s)(x, positions))
  plain = lambda s, x: jnp.sum(cot * plain_bcmt_mixer(
      nnx.to_pure_dict(s), x, num_heads=cfg.num_heads, block_size=L, alpha=0.7,
      rope_base=cfg.rope_base))
  (got, got_grads), (want, want_grads) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(state, x_BTD)
                                          for f in (fast, plain))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  flat_got, flat_want = (jax.tree_util.tree_leaves_with_path(g) for g in (got_grads, want_grads))
  assert len(flat_got) == len(flat_want) == len(leaves) + 1
  for (path, g), (_, w) in zip(flat_got, flat_want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-4, err_msg=jax.tree_util.keystr(path))
