"""The Perceiver-AR family: its two ops against dense masked references, shapes, leaks, config errors, training."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from efficient_lm import models
from efficient_lm.models import perceiver_ar
from efficient_lm.ops import attention
from efficient_lm.ops.attention import causal_cross_attention, segment_attention
from efficient_lm.ops.route import Route
from efficient_lm.training import loop as train
from efficient_lm.training import step as train_step
from conftest import build, fast_first, load_config
from efficient_lm.config.errors import ConfigError
from test_models import tiny_model_config

VARIANTS = ("perceiver_ar", "double_attention", "compressed_double_attention",
            "ssplit_double_attention")
DOUBLES = VARIANTS[1:]


def normal(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def dense_masked(q_BZHK, k_BTHK, v_BTHK, allowed_ZT):
  """softmax over allowed j of q_z . k_j / sqrt(K): the plain reference."""
  logits = jnp.einsum("bzhk,bthk->bhzt", q_BZHK, k_BTHK) / np.sqrt(q_BZHK.shape[-1])
  logits = jnp.where(jnp.asarray(allowed_ZT)[None, None], logits, -jnp.inf)
  return jnp.einsum("bhzt,bthk->bzhk", jax.nn.softmax(logits, axis=-1), v_BTHK)


def assert_same_function(fast, reference, args, atol=2e-5):
  """Same values, and same gradients of a non-linear readout, for every argument."""
  np.testing.assert_allclose(jax.jit(fast)(*args), jax.jit(reference)(*args), atol=atol, rtol=atol)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(3.0 * f(*a)))
  grad = lambda f: jax.jit(jax.grad(loss(f), tuple(range(len(args)))))(*args)
  for got, want in zip(grad(fast), grad(reference)):
    np.testing.assert_allclose(got, want, atol=10 * atol, rtol=10 * atol)


@pytest.mark.parametrize("Z,T,offset", fast_first([(5, 37, 10), (8, 32, 24), (1, 9, 8)]))
def test_causal_cross_attention_equals_dense_masked(Z, T, offset):
  allowed = np.array([[j <= offset + z for j in range(T)] for z in range(Z)])
  args = (normal((2, Z, 2, 8), 0), normal((2, T, 2, 8), 1), normal((2, T, 2, 8), 2))
  assert_same_function(lambda q, k, v: causal_cross_attention(q, k, v, query_offset=offset),
                       lambda q, k, v: dense_masked(q, k, v, allowed), args)


def test_cross_attention_of_every_position_is_causal_attention():
  q, k, v = (normal((2, 16, 2, 8), s) for s in range(3))
  np.testing.assert_allclose(causal_cross_attention(q, k, v, query_offset=0),
                             attention.causal_attention(q, k, v), atol=1e-5)


def test_cross_attention_rejects_an_offset_past_the_keys():
  q, k = normal((1, 4, 1, 8), 0), normal((1, 10, 1, 8), 1)
  with pytest.raises(ValueError, match="query_offset"):
    causal_cross_attention(q, k, k, query_offset=7)


@pytest.mark.parametrize("T,num_segments", [(24, 1), (24, 3)])
def test_segment_attention_equals_dense_masked(T, num_segments):
  L = T // num_segments
  allowed = np.array([[i // L == j // L for j in range(T)] for i in range(T)])
  args = tuple(normal((2, T, 2, 8), s) for s in range(3))
  assert_same_function(lambda q, k, v: segment_attention(q, k, v, num_segments=num_segments),
                       lambda q, k, v: dense_masked(q, k, v, allowed), args)


def make(name, **overrides):
  cfg = tiny_model_config(name, **overrides)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
  return cfg, lambda tokens: forward(params, tokens)


@pytest.mark.parametrize("name", fast_first(VARIANTS, keep=2))
def test_logits_loss_mask_and_no_leak_between_latents(name):
  """Logits `[B, Z, V]`, scored against the last Z targets; changing the token at latent
  position p changes outputs >= p only (the history may be bidirectional, the latents may not);
  a history token reaches every latent."""
  cfg, forward = make(name)
  T, Z = cfg.seq_len, cfg.num_latents
  tokens = jax.random.randint(jax.random.key(3), (2, T + 1), 0, cfg.vocab_size)
  inputs = tokens[:, :-1]
  base = forward(inputs)
  assert base.shape == (2, Z, cfg.vocab_size)
  nll, weight = train_step.weighted_nll(base, tokens[:, 1:], jnp.ones((2, T), jnp.float32))
  assert float(weight) == 2 * Z and np.isfinite(float(nll))  # the loss mask: the last Z targets
  for p in (T - Z, T - Z + 3, T - 1):
    changed = forward(inputs.at[:, p].set((inputs[:, p] + 1) % cfg.vocab_size))
    z = p - (T - Z)
    np.testing.assert_array_equal(changed[:, :z], base[:, :z], err_msg=f"{name}: latent {p} leaks back")
    assert not np.allclose(changed[:, z], base[:, z]), f"{name}: output {p} ignores token {p}"
  changed = forward(inputs.at[:, 2].set((inputs[:, 2] + 1) % cfg.vocab_size))
  assert not np.any(np.all(np.isclose(changed, base), axis=-1)), f"{name}: history token 2 unused"


def test_compressed_model_needs_its_seq_len():
  cfg = tiny_model_config("compressed_double_attention")
  model = models.create(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="history of 24"):
    model(jnp.zeros((1, cfg.seq_len + 4), jnp.int32))


@pytest.mark.parametrize("name,overrides,field", [
    ("perceiver_ar", dict(num_latents=0), "model.num_latents"),
    ("double_attention", dict(num_latents=33), "model.num_latents"),
    ("compressed_double_attention", dict(compression=5), "model.compression"),
    ("ssplit_double_attention", dict(num_history_segments=5), "model.num_history_segments"),
    ("compressed_double_attention", dict(compression_op="conv"), "model.compression_op"),
])
def test_validation_names_the_field(name, overrides, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    models.create(tiny_model_config(name, **overrides), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("preset", [None, "double", "compressed", "ssplit"])
def test_config_presets_are_valid(preset):
  config = load_config("perceiver_ar", preset)
  models.validate(build(config).model)


class DenseMaskRoute(Route):
  """A route that ignores the pattern and attends through hand-built dense masks: the latents
  causally over the whole stream (q_start: the first latent's position), the history inside
  `history_segments` equal segments; it records which of the two each call was."""

  def __init__(self, history_segments: int, calls: list):
    super().__init__()
    object.__setattr__(self, "history_segments", history_segments)
    object.__setattr__(self, "calls", calls)

  def attend(self, q, k, v, pattern, *, q_start=None, **kwargs):
    del pattern, kwargs
    Z, T = q.shape[1], k.shape[1]
    if q_start is not None:
      self.calls.append("latents")
      return dense_masked(q, k, v, np.arange(T)[None] <= q_start + np.arange(Z)[:, None])
    self.calls.append("history")
    seg = np.arange(T) // (T // self.history_segments)
    return dense_masked(q, k, v, seg[:, None] == seg[None, :])


@pytest.mark.slow  # ~20 s a variant (ECP's reference model is in the fast tier)
@pytest.mark.parametrize("name", VARIANTS)
def test_variant_equals_a_dense_masked_reference_model(name):
  """The whole model with its attentions replaced by plain dense masked ones: same loss and gradients."""
  cfg = tiny_model_config(name, num_history_segments=4 if name == "ssplit_double_attention" else 3)
  tokens = jax.random.randint(jax.random.key(4), (2, cfg.seq_len), 0, cfg.vocab_size)
  fast = models.create(cfg, rngs=nnx.Rngs(0))
  calls = []
  route = DenseMaskRoute(fast.history_segments, calls)
  reference = perceiver_ar.build(cfg, nnx.Rngs(0), route=route)

  def loss_and_grad(model):
    graphdef, params = nnx.split(model)
    f = lambda p: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(tokens)))
    return jax.value_and_grad(f)(params)

  (got, got_grad), (want, want_grad) = loss_and_grad(fast), loss_and_grad(reference)
  assert "latents" in calls and ("history" in calls) == (name in DOUBLES)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4)


@pytest.mark.slow  # 15-20 s
def test_strided_compression_starts_as_the_learned_map_and_has_parameters_independent_of_T():
  """Both compressions start as mean pooling of groups of `compression` tokens: with the same other
  weights the two models give the same logits at initialization. The learned map has
  (T - Z)^2 / compression parameters; the strided one compression x d_model at any T."""
  learned = models.create(tiny_model_config("compressed_double_attention"), rngs=nnx.Rngs(0))
  strided = models.create(tiny_model_config("compressed_double_attention", compression_op="strided"),
                          rngs=nnx.Rngs(0))
  assert learned.compress.shape == (24, 6) and strided.compress.shape == (4, 32)
  tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 64)
  np.testing.assert_allclose(strided(tokens), learned(tokens), atol=1e-5)
  count = lambda model: sum(x.size for x in jax.tree.leaves(nnx.state(model)))
  sizes = {T: {op: count(models.create(tiny_model_config("compressed_double_attention", seq_len=T,
                                                          compression_op=op), rngs=nnx.Rngs(0)))
               for op in ("learned", "strided")} for T in (32, 128)}
  assert sizes[128]["strided"] == sizes[32]["strided"]
  assert sizes[128]["learned"] - sizes[32]["learned"] == (120 ** 2 - 24 ** 2) // 4


@pytest.mark.slow  # 15-20 s
def test_strided_compression_weights_get_gradients():
  """A different weighting of each group changes the logits: the weights train."""
  cfg = tiny_model_config("compressed_double_attention", compression_op="strided")
  graphdef, params = nnx.split(models.create(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 64)
  grads = jax.grad(lambda p: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(tokens))))(params)
  assert float(jnp.max(jnp.abs(grads["compress"][...]))) > 1e-4
