"""π-Attention on a kernel: the local part through the kernel, the skips beside it, one softmax.

A kernel computes the local part (the window, no priors) as `(o_l, lse_l)`.
The local prior adds a constant to every local logit of a row, so it only
shifts lse_l. Each skip distance d is one strided dot product: query i against
the key at index i - d - k_offset (a static shift of k), plus the skip prior.
The union's softmax is the log-sum-exp merge of the two parts, exactly the
one-softmax definition (`core.attend` on `xla` computes the same thing in one
pass). Autodiff carries the cotangents; the kernel sees one on o_l and one on
lse_l.
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops import precision
from efficient_lm.ops.core.plan import MASKED, NO_KEY_LSE

F32 = jnp.float32


def _shift(x_BTHK: jax.Array, offset: int, length: int) -> jax.Array:
  """`out[:, i] = x[:, i + offset]` for i < length, zeros where that is outside x (static slices)."""
  T = x_BTHK.shape[1]
  lo, hi = max(offset, 0), min(offset + length, T)
  if lo >= hi:
    return jnp.zeros((x_BTHK.shape[0], length, *x_BTHK.shape[2:]), x_BTHK.dtype)
  piece = x_BTHK[:, lo:hi]
  return jnp.pad(piece, [(0, 0), (lo - offset, offset + length - hi), (0, 0), (0, 0)])


def kernel_attend(local_attend, call, q, k, v, q_start, local_prior, skip_prior,
                  q_segments=None, k_segments=None):
  """(o, lse) of a kernel backend's call from `local_attend(q, k, v) -> (o_l, lse_l)`, the kernel
  on the call's local part: the skips beside it when the pattern has them (`attend_with_skips`),
  the local prior as a shift of lse."""
  if call.pattern.skips:
    return attend_with_skips(local_attend, call, q, k, v, q_start, local_prior, skip_prior,
                             q_segments, k_segments)
  o, lse = local_attend(q, k, v)
  return o, _with_prior(lse, local_prior)


def _with_prior(lse: jax.Array, prior: jax.Array | None) -> jax.Array:
  """A prior is a constant on every logit of its row: lse moves by it (o does not)."""
  if prior is None:
    return lse
  return jnp.where(lse > NO_KEY_LSE, lse + prior.astype(F32), NO_KEY_LSE)


def attend_with_skips(local_attend, call, q, k, v, q_start, local_prior, skip_prior,
                      q_segments=None, k_segments=None):
  """(o, lse) of π's pattern from `local_attend(q, k, v) -> (o_l, lse_l)` (the kernel's local
  part, no priors, in `call.layout`, documents masked) and the skips of `call.pattern` (a skip
  key of another document is dropped). Needs a static `call.k_offset`; priors and lse in the
  call's layout; document ids `[B, Tq]`, `[B, Tk]`."""
  heads_first = call.layout == "BHTK"
  o_l, lse_l = local_attend(q, k, v)
  if heads_first:  # the skips are computed [B, T, H, ...]
    q, k, v, o_l = (jnp.swapaxes(x, 1, 2) for x in (q, k, v, o_l))
    lse_l, local_prior, skip_prior = (None if x is None else jnp.swapaxes(x, 1, 2)
                                      for x in (lse_l, local_prior, skip_prior))
  lse_l = _with_prior(lse_l.astype(F32), local_prior)
  q_pos_T = jnp.asarray(q_start, jnp.int32) + jnp.arange(call.Tq, dtype=jnp.int32)
  logits, values = [], []
  for d in call.pattern.skips:
    offset = -(d + call.k_offset)  # the key of query i sits at index i + offset
    k_d, v_d = _shift(k, offset, call.Tq), _shift(v, offset, call.Tq)
    index_T = jnp.arange(call.Tq) + offset
    present_BT = ((q_pos_T - d >= 0) & (index_T >= 0) & (index_T < call.Tk))[None]
    if q_segments is not None:
      present_BT = present_BT & (q_segments == _shift(k_segments[..., None, None], offset,
                                                      call.Tq)[:, :, 0, 0])
    s_BTH = precision.einsum_f32("bthk,bthk->bth", q, k_d) * call.scale
    if skip_prior is not None:
      s_BTH = s_BTH + skip_prior.astype(F32)
    logits.append(jnp.where(present_BT[:, :, None], s_BTH, MASKED))
    values.append(v_d)
  s_BTHS = jnp.stack(logits, axis=-1)
  peak = jax.lax.stop_gradient(jnp.maximum(lse_l, jnp.max(s_BTHS, axis=-1)))
  w_local = jnp.exp(lse_l - peak)
  w_BTHS = jnp.exp(s_BTHS - peak[..., None])
  total = w_local + jnp.sum(w_BTHS, axis=-1)
  safe = jnp.where(total > 0, total, 1.0)
  lse = jnp.where(peak > NO_KEY_LSE / 2, peak + jnp.log(safe), NO_KEY_LSE)
  o = (w_local / safe)[..., None] * o_l.astype(F32)
  for s, v_d in enumerate(values):
    o = o + (w_BTHS[..., s] / safe)[..., None] * v_d.astype(F32)
  o = o.astype(q.dtype)
  if heads_first:
    o, lse = jnp.swapaxes(o, 1, 2), jnp.swapaxes(lse, 1, 2)
  return o, lse
