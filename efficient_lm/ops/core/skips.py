"""π-Attention on a kernel: the local part through the kernel, the skips beside it, one softmax.

A kernel computes the local part (the window, no priors) as `(o_l, lse_l)`.
The local prior adds a constant to every local logit of a row, so it only
shifts lse_l. The skips are π's stride, one piece however many they are: the
XLA core's `stride_attend` (a shifted view of the keys per skip for a few, else
keys viewed as `[T / period, period]`, a window along the row axis per column;
the skip prior on its logits; its own custom VJP). The union's
softmax is the log-sum-exp merge of the two parts, exactly the one-softmax
definition. Like the kernel, the stride piece runs per shard of the mesh
(`kernel_mesh.per_shard`: each device's batch rows and heads). Autodiff
carries the cotangents; the kernel sees one on o_l and one on lse_l.
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops.core import kernel_mesh, xla
from efficient_lm.ops.core.merge import merge
from efficient_lm.ops.core.plan import NO_KEY_LSE

F32 = jnp.float32


def kernel_attend(local_attend, call, q, k, v, q_start, local_prior, skip_prior,
                  q_segments=None, k_segments=None):
  """(o, lse) of a kernel backend's call from `local_attend(q, k, v) -> (o_l, lse_l)`, the kernel
  on the call's local part: the skips beside it when the pattern has them (`attend_with_skips`),
  the local prior as a shift of lse."""
  if call.pattern.has_skips:
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
  part, no priors, in `call.layout`, documents masked) and the stride of `call.pattern` (a skip
  key of another document is dropped). Needs a static `call.k_offset`; priors and lse in the
  call's layout; document ids `[B, Tq]`, `[B, Tk]`."""
  o_l, lse_l = local_attend(q, k, v)
  local = (o_l, _with_prior(lse_l.astype(F32), local_prior))
  return merge([local, _stride(call, q, k, v, q_start, skip_prior, q_segments, k_segments)])


def _stride(call, q, k, v, q_start, skip_prior, q_segments, k_segments):
  """`xla.stride_attend` on each device's own batch rows and heads (attention mixes neither)."""
  static = isinstance(q_start, int)
  start = None if static else jnp.reshape(jnp.asarray(q_start, jnp.int32), (1,))

  def stride(q, k, v, start, sp, qseg, kseg):
    return xla.stride_attend(call, q, k, v, q_start if static else start[0], sp, qseg, kseg)

  arrays = [q, k, v, start, skip_prior, q_segments, k_segments]
  kinds = ["qkv", "kv", "kv", "replicated", "rows", "ids", "ids"]
  kinds = [kind if x is not None else "none" for x, kind in zip(arrays, kinds)]
  return kernel_mesh.per_shard(stride, arrays, kinds, ["qkv", "rows"], layout=call.layout)
