"""ECP: the whole model equals the shared decoder with a dense masked attention of ECP's pattern."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import fast_first
from efficient_lm import models
from efficient_lm.config.errors import ConfigError
from efficient_lm.models import decoder
from efficient_lm.models import ecp
from efficient_lm.ops.route import Route
from test_models import tiny_model_config


def ecp_mask(T, L):
  """Piece t = i // L attends to all of piece t - 1 and causally to piece t."""
  return np.array([[j <= i and j // L >= i // L - 1 for j in range(T)] for i in range(T)])


@dataclasses.dataclass(frozen=True)
class DenseMaskRoute(Route):
  """A route that ignores the pattern and attends through the hand-built ECP mask (dense)."""
  piece: int = 0

  def attend(self, q, k, v, pattern, **kwargs):
    del pattern, kwargs
    allowed = jnp.asarray(ecp_mask(q.shape[1], self.piece))
    logits = jnp.einsum("bihk,bjhk->bhij", q, k) / np.sqrt(q.shape[-1])
    logits = jnp.where(allowed[None, None], logits, -jnp.inf)
    return jnp.einsum("bhij,bjhk->bihk", jax.nn.softmax(logits, axis=-1), v)


def build(cfg, route=None):
  kwargs = {} if route is None else dict(route=route)
  return decoder.Decoder(cfg, lambda layer, rngs: ecp.make_mixer(cfg, layer, rngs, **kwargs),
                         identical_layers=cfg.identical_layers, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("options", fast_first([
    dict(), dict(shared_kv=True, rope_first_layer_only=True, num_segments=32)], keep=(1,)))
def test_ecp_equals_dense_masked_reference_model(options):
  cfg = tiny_model_config("ecp", **options)
  T, L = cfg.seq_len, cfg.seq_len // cfg.num_segments
  fast, reference = build(cfg), build(cfg, route=DenseMaskRoute(piece=L))
  tokens = jax.random.randint(jax.random.key(0), (2, T), 0, cfg.vocab_size)

  def loss_and_grad(model):
    graphdef, params = nnx.split(model)
    f = lambda p: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(tokens)))
    return jax.jit(jax.value_and_grad(f))(params)

  (got, got_grad), (want, want_grad) = loss_and_grad(fast), loss_and_grad(reference)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4)


def test_options_change_the_model():
  """Shared k/v has fewer parameters; RoPE in layer 1 only unrolls the (no longer identical) layers."""
  count = lambda cfg: sum(x.size for x in jax.tree.leaves(nnx.state(build(cfg), nnx.Param)))
  assert count(tiny_model_config("ecp", shared_kv=True)) < count(tiny_model_config("ecp"))
  assert not tiny_model_config("ecp", rope_first_layer_only=True).identical_layers


@pytest.mark.parametrize("overrides,field", [
    (dict(num_segments=5), "model.num_segments"),
    (dict(num_segments=0), "model.num_segments"),
])
def test_validation_names_the_field(overrides, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    models.create(tiny_model_config("ecp", **overrides), rngs=nnx.Rngs(0))
