"""Every family on the kernel backends: `model.attention_impl='splash' | 'gpu'` with
`model.kernel_interpret=True` (Pallas interpret mode on this CPU) computes what `xla` does.

Loss and every parameter gradient of a tiny model of each family, whole windows and sequence
chunks (a traced chunk start with a static key offset: the kernels' masks from the pattern);
and a short training run through the loop on the splash kernel, step for step the xla run's
losses.
"""

import jax
import numpy as np
import pytest

from conftest import build, fast_first
from flax import nnx

from efficient_lm import models
from efficient_lm.ops import core
from efficient_lm.ops.core import backends
from efficient_lm.training import step as train_step
from test_models import tiny_model_config

# Every registered model but these, whose attention patterns another case already puts on the
# kernels (each kernel run in interpret mode costs seconds): the reason for each.
SAME_PATTERNS_AS = {
    "compressed_double_attention": "double_attention's (dense latents, history segments; only "
                                   "the history's length differs)",
    "ssplit_double_attention": "double_attention's (history segments of another length)",
}
FAMILIES = sorted(models.REGISTRY, key=lambda n: n != "dense")  # dense first: the fast tier's
FAMILIES = [name for name in FAMILIES if name not in SAME_PATTERNS_AS]


def loss_and_grads(cfg, tokens_BT):
  model = models.create(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  batch = {"inputs": tokens_BT[:, :-1], "targets": tokens_BT[:, 1:],
           "weights": np.ones(tokens_BT[:, 1:].shape, np.float32)}

  def loss(params):
    nll, weight = train_step.model_nll(nnx.merge(graphdef, params), batch)
    return nll / weight

  return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("impl", fast_first(["splash", "gpu"], keep=(1,)))
@pytest.mark.parametrize("name", fast_first(FAMILIES))
def test_every_family_on_a_kernel_equals_xla(name, impl):
  chunk = {"seq_chunk": 16} if models.chunkable(tiny_model_config(name)) else {}
  tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 64)
  want_loss, want = loss_and_grads(tiny_model_config(name, attention_impl="xla", **chunk), tokens)
  fallbacks, kernel_calls = sum(core.FALLBACKS.values()), sum(backends.KERNEL_CALLS.values())
  got_loss, got = loss_and_grads(
      tiny_model_config(name, attention_impl=impl, kernel_interpret=True, **chunk), tokens)
  assert sum(core.FALLBACKS.values()) == fallbacks, core.FALLBACKS  # every call on the kernel
  assert sum(backends.KERNEL_CALLS.values()) > kernel_calls  # the kernel ran: not xla against xla
  np.testing.assert_allclose(got_loss, want_loss, rtol=2e-5)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-4)


@pytest.mark.slow
def test_training_on_the_splash_kernel_matches_xla(tiny_config, tmp_path):
  """The training loop on the interpreted splash kernel: the losses of the xla run."""
  from efficient_lm.training import loop as train  # pylint: disable=import-outside-toplevel
  losses = {}
  for impl in ("xla", "splash"):
    config = tiny_config("pi_attention", num_steps=6, log_every=1, eval_every=6,
                         checkpoint_every=6, sample_tokens=0)
    config.model.update(attention_impl=impl, kernel_interpret=impl != "xla", seq_chunk=16)
    train.train_and_evaluate(build(config), str(tmp_path / impl))
    lines = (tmp_path / impl / "metrics.jsonl").read_text().splitlines()
    import json  # pylint: disable=import-outside-toplevel
    losses[impl] = [json.loads(l)["loss"] for l in lines if '"loss"' in l]
  assert len(losses["xla"]) == 6
  np.testing.assert_allclose(losses["splash"], losses["xla"], rtol=1e-4)
