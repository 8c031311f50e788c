"""π's visible-slot decoding buffer (`layers.kv_cache_step`): a decoding step that reads only the
window's slots and one per skip gives what the whole ring gives, and what the dense masked
reference gives, forward and gradient, on random inputs with empty slots and document boundaries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from efficient_lm.models import layers
from efficient_lm.ops.pattern import Pattern
from efficient_lm.ops.route import Route

D, H = 32, 2


def attention(pattern: Pattern, impl: str = "xla") -> layers.SelfAttention:
  return layers.SelfAttention(D, H, pattern, route=Route(impl=impl), use_rope=True,
                              rope_base=10_000.0, dtype=jnp.float32, rngs=nnx.Rngs(0))


def without_visible(cache: dict) -> dict:
  """The same cache with no visible-slot buffer: a step then reads the whole ring."""
  return {name: a for name, a in cache.items() if not name.startswith("vis_")}


def test_visible_slots_are_the_window_and_the_skips_under_the_span():
  assert layers.visible_slots(Pattern.pi(128, 128, 3), 385) == layers.Visible(128, (128, 256, 384))
  assert layers.visible_slots(Pattern.pi(4, 8, 2), 6) == layers.Visible(4, ())  # skips not cached
  assert layers.visible_slots(Pattern.sliding(8), 8) is None  # the window fills the ring
  assert layers.visible_slots(Pattern.dense(), 100) is None
  assert layers.visible_slots(Pattern.blocks(8, 1), 16) is None


# window 4, skips 6 and 9 (span 10, 6 visible slots); window 3, skips 4 and 6 (span 7, 5 slots).
@pytest.mark.parametrize("pattern,prompt_len,with_grad", [
    (Pattern.pi(4, 3, 3), 5, True),  # skips to empty slots first, then the ring wraps around
    pytest.param(Pattern.pi(3, 2, 3), 13, False, marks=pytest.mark.slow),  # wrapped in the prompt
], ids=["w4-p3", "w3-p2-long-prompt"])
def test_decoding_steps_read_the_visible_slots_as_the_ring_and_the_reference(pattern, prompt_len,
                                                                             with_grad):
  B, steps = 3, 8
  fast, reference = attention(pattern), attention(pattern, "reference")
  nnx.update(reference, nnx.state(fast))
  x_BTD = jax.random.normal(jax.random.key(1), (B, prompt_len + steps, D))
  # Documents: row 0 one, rows 1 and 2 new ones at random positions (prompt and decoded part).
  starts_BT = jax.random.bernoulli(jax.random.key(2), 0.2, (B, prompt_len + steps)).at[0].set(False)
  seg_BT = jnp.cumsum(starts_BT, axis=1, dtype=jnp.int32)
  positions_BT = jnp.broadcast_to(jnp.arange(prompt_len), (B, prompt_len))

  def run(module, x_BTD, strip: bool):
    cache = module.init_cache(B, 100)
    y_BPD, cache = module.prefill(x_BTD[:, :prompt_len], positions_BT, cache, seg_BT[:, :prompt_len])
    outs = [y_BPD]
    for t in range(prompt_len, prompt_len + steps):
      if strip:
        cache = without_visible(cache)
      y_B1D, cache = module.extend(x_BTD[:, t:t + 1], t, cache, seg_BT[:, t:t + 1])
      outs.append(y_B1D)
    return jnp.concatenate(outs, axis=1)

  assert "vis_k" in fast.init_cache(B, 100)
  got = jax.jit(lambda x: run(fast, x, False))(x_BTD)
  ring = jax.jit(lambda x: run(fast, x, True))(x_BTD)
  want = jax.jit(lambda x: run(reference, x, True))(x_BTD)
  np.testing.assert_allclose(got, ring, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  # The whole sequence in one parallel pass (the reference backend) gives the same outputs.
  np.testing.assert_allclose(got, reference(x_BTD, jnp.broadcast_to(
      jnp.arange(x_BTD.shape[1]), x_BTD.shape[:2]), seg_BT), atol=1e-5, rtol=1e-5)

  if not with_grad:
    return
  cotangent = jax.random.normal(jax.random.key(3), got.shape)
  grad = lambda module, strip: jax.jit(jax.grad(
      lambda x: jnp.sum(run(module, x, strip) * cotangent)))(x_BTD)
  np.testing.assert_allclose(grad(fast, False), grad(reference, True), atol=1e-4, rtol=1e-4)


def test_a_step_refills_the_skip_slots_from_the_ring():
  """After a chunk and a step at position t, the buffer holds exactly the ring's keys at the
  positions t - d for d in the window and the skips (-1 where none is cached yet)."""
  pattern = Pattern.pi(3, 4, 2)  # skips 4, 8: span 9, 5 visible slots
  module = attention(pattern)
  x_BTD = jax.random.normal(jax.random.key(4), (2, 11, D))
  cache = module.init_cache(2, 100)
  _, cache = module.prefill(x_BTD[:, :10], jnp.broadcast_to(jnp.arange(10), (2, 10)), cache)
  _, cache = module.extend(x_BTD[:, 10:], 10, cache)
  want_pos = [10 - d for d in (0, 1, 2)] + [10 - 4, 10 - 8]
  got_pos = np.asarray(cache["vis_pos"])
  assert sorted(got_pos[:3].tolist()) == sorted(want_pos[:3]) and got_pos[3:].tolist() == want_pos[3:]
  span = cache["pos"].shape[0]
  for slot, p in enumerate(got_pos):
    np.testing.assert_array_equal(cache["vis_k"][:, slot], cache["k"][:, p % span])
    np.testing.assert_array_equal(cache["vis_v"][:, slot], cache["v"][:, p % span])
