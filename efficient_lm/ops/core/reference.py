"""The `reference` backend: attention as a plain masked softmax over the `[Tq, Tk]` logits.

O(Tq Tk) time and memory: for tests, and for comparing against at small sizes
(the dense model's `attention_impl='reference'`). Differentiated by autodiff. Grouped
key/value heads as everywhere (`heads.einsum`).
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops.core import heads
from efficient_lm.ops.core.call import Backend
from efficient_lm.ops.core.plan import MASKED, NO_KEY_LSE

F32 = jnp.float32


def attend(call, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior, q_segments,
           k_segments, *, interpret: bool = False):
  del interpret
  heads_first = call.layout == "BHTK"
  if not heads_first:  # compute heads-first: [B, H, T, K]; priors [B, H, Tq]
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    local_prior, skip_prior = (None if p is None else jnp.swapaxes(p, 1, 2)
                               for p in (local_prior, skip_prior))
  q_pos = jnp.asarray(q_start, jnp.int32) + jnp.arange(call.Tq, dtype=jnp.int32)
  if k_positions is None:
    k_pos = jnp.asarray(k_start, jnp.int32) + jnp.arange(call.Tk, dtype=jnp.int32)
  else:
    k_pos = jnp.asarray(k_positions, jnp.int32)
  local = call.pattern.local_visible(q_pos[:, None], k_pos[None, :])
  skip = call.pattern.skip_visible(q_pos[:, None], k_pos[None, :]) if call.pattern.has_skips else None
  if q_segments is not None:  # [B, 1, Tq, Tk]: keys of the query's own document only
    same = (q_segments[:, :, None] == k_segments[:, None, :])[:, None]
    local = local & same
    skip = None if skip is None else skip & same
  s = heads.einsum("bhqk,bhsk->bhqs", q, k, k.shape[1]) * call.scale
  s_local = s if local_prior is None else s + local_prior.astype(F32)[..., None]
  if skip is None:
    s = jnp.where(local, s_local, MASKED)
  else:
    s_skip = s if skip_prior is None else s + skip_prior.astype(F32)[..., None]
    s = jnp.where(local, s_local, jnp.where(skip, s_skip, MASKED))
  seen = local if skip is None else local | skip
  peak = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  e = jnp.where(seen, jnp.exp(s - peak), 0.0)
  total = jnp.sum(e, axis=-1)
  safe = jnp.where(total > 0, total, 1.0)
  lse = jnp.where(total > 0, peak[..., 0] + jnp.log(safe), NO_KEY_LSE)
  p = e / safe[..., None]
  o = heads.einsum("bhqs,bhsk->bhqk", p.astype(v.dtype), v, v.shape[1]).astype(q.dtype)
  if not heads_first:
    o, lse = jnp.swapaxes(o, 1, 2), jnp.swapaxes(lse, 1, 2)
  return o, lse


BACKEND = Backend(
    name="reference", attend=attend,
    doc="the plain masked softmax over [Tq, Tk] logits: O(T^2) time and memory (tests)")
