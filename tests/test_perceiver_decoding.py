"""Cached decoding of the Perceiver-AR family equals one full pass with the same history.

After `prefill` of a prompt of P tokens the history is h = P - min(Z, P); every later token is a
latent. The reference is the model run once on the whole sequence with num_latents = N - h (the
parameters do not depend on num_latents), whose logits cover positions h..N-1.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fast_first
from flax import nnx

from efficient_lm import models
from test_models import tiny_model_config

TOL = dict(atol=1e-4, rtol=1e-4)

# (variant, prompt length P, total length N = max_len, extend chunk also checked, fields); tiny
# configs: seq_len 32, Z = 8, 3 history segments, 4 heads.
CASES = [
    ("perceiver_ar", 20, 40, 3, {}),                 # h = 12, decoding past seq_len (RoPE)
    ("perceiver_ar", 5, 24, 1, {}),                  # a prompt shorter than Z: all latents
    ("double_attention", 20, 40, 1, {}),
    ("compressed_double_attention", 32, 40, 3, {}),  # must prefill exactly seq_len tokens: h = 24
    ("ssplit_double_attention", 20, 40, 3, {}),      # h = 12, 3 segments of 4
    ("perceiver_ar", 20, 40, 3, dict(num_kv_heads=1)),      # multi-query attention ...
    ("double_attention", 20, 40, 3, dict(num_kv_heads=2)),  # ... and grouped-query
]


def setup(name, P, N, seed=0, **fields):
  model = models.create(tiny_model_config(name, **fields), rngs=nnx.Rngs(seed))
  tokens = jax.random.randint(jax.random.key(seed + 1), (2, N), 0, model.embed.num_embeddings)
  history = P - min(model.num_latents, P)
  return model, tokens, history


def forward(model, tokens):
  """`model(tokens)`, jitted."""
  graphdef, params = nnx.split(model)
  return jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))(params, tokens)


def full_pass(model, tokens, history):
  """Logits of positions history..N-1 from one parallel pass (num_latents set to N - history)."""
  Z = model.num_latents
  model.num_latents = tokens.shape[1] - history
  try:
    return forward(model, tokens)
  finally:
    model.num_latents = Z


def prefill(model, prompt, max_len):
  """(logits, cache) of a jitted `prefill` from a fresh cache."""
  graphdef, params = nnx.split(model)
  run = lambda params, prompt: nnx.merge(graphdef, params).prefill(
      prompt, nnx.merge(graphdef, params).init_cache(prompt.shape[0], max_len))
  return jax.jit(run)(params, prompt)


def decode_one_at_a_time(model, cache, tokens, P):
  """Logits of positions P..N-1: jitted `decode_step`s (`extend` of one token) under lax.scan,
  the cache in the carry."""
  graphdef, params = nnx.split(model)

  @jax.jit
  def decode_all(params, cache, tokens):
    def body(carry, t):  # params ride in the carry so the module is built at the body's level
      params, cache = carry
      logits, cache = nnx.merge(graphdef, params).decode_step(tokens[:, t], cache, t)
      return (params, cache), logits
    _, logits_TBV = jax.lax.scan(body, (params, cache), jnp.arange(P, tokens.shape[1]))
    return jnp.swapaxes(logits_TBV, 0, 1)

  return decode_all(params, cache, tokens)


def decode_in_chunks(model, cache, tokens, P, chunk):
  """Logits of positions P..N-1: a jitted `extend` of `chunk` tokens (the last may be shorter)."""
  graphdef, params = nnx.split(model)
  extend = jax.jit(lambda params, cache, chunk_BC, start: nnx.merge(graphdef, params).extend(
      chunk_BC, cache, start))
  out = []
  for start in range(P, tokens.shape[1], chunk):
    logits, cache = extend(params, cache, tokens[:, start:start + chunk], jnp.int32(start))
    out.append(logits)
  return jnp.concatenate(out, axis=1)


@pytest.mark.parametrize("name,P,N,chunk,fields", fast_first(CASES, keep=(1,)))
def test_cached_decoding_equals_the_full_pass(name, P, N, chunk, fields):
  model, tokens, h = setup(name, P, N, **fields)
  expected = full_pass(model, tokens, h)  # positions h..N-1
  first_logits, cache = prefill(model, tokens[:, :P], N)
  if P >= model.num_latents:  # prefill == model(prompt) (which needs Z tokens)
    np.testing.assert_allclose(first_logits, forward(model, tokens[:, :P]), **TOL)
  np.testing.assert_allclose(first_logits, expected[:, :P - h], **TOL)
  decoded = decode_one_at_a_time(model, cache, tokens, P)
  np.testing.assert_allclose(decoded, expected[:, P - h:], **TOL)
  if chunk > 1:  # chunked prefill: chunks of C and a ragged last one, as one token at a time
    np.testing.assert_allclose(decode_in_chunks(model, cache, tokens, P, chunk), decoded, **TOL)


def test_cache_slots_follow_max_len():
  """One slot per stream position: compression keeps history / compression slots of the history."""
  for name, slots in (("double_attention", 48), ("compressed_double_attention", 48 - 24 + 6)):
    model = models.create(tiny_model_config(name), rngs=nnx.Rngs(0))
    cache = model.init_cache(3, 48)
    assert cache["first"]["k"].shape == (3 * 4, slots, 8)  # [B * H, slots, K]
    assert [layer["v"].shape for layer in cache["rest"]] == [(3 * 4, slots, 8)]


@pytest.mark.parametrize("name,fields,P,max_len,match", [
    ("double_attention", {}, 20, 16, "max_len=16"),                 # prompt longer than the cache
    ("perceiver_ar", {}, 0, 16, "max_len=16"),                      # empty prompt
    ("compressed_double_attention", {}, 20, 40, "seq_len=32"),      # not exactly seq_len
    ("ssplit_double_attention", {}, 22, 40, "num_history_segments=3"),
])
def test_a_prompt_that_does_not_fit_is_refused_before_compile(name, fields, P, max_len, match):
  model = models.create(tiny_model_config(name, **fields), rngs=nnx.Rngs(0))
  cache = model.init_cache(1, max_len)
  with pytest.raises(ValueError, match=match):
    jax.jit(model.prefill)(jnp.zeros((1, P), jnp.int32), cache)  # raised while tracing


def test_cache_limits_are_refused():
  model = models.create(tiny_model_config("perceiver_ar"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="max_len=16"):  # positions 15, 16 of a 16-token cache
    model.extend(jnp.zeros((1, 2), jnp.int32), model.init_cache(1, 16), 15)
  learned = models.create(tiny_model_config("double_attention", position="learned"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="seq_len=32"):
    learned.init_cache(1, 33)
  compressed = models.create(tiny_model_config("compressed_double_attention"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="seq_len=32"):
    compressed.init_cache(1, 24)
