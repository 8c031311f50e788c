"""The blockwise online-softmax core on XLA: the `xla` backend, every platform.

A call's local part runs as a `plan.Plan` on one of two schedules: `banded.py`
(a pattern of bounded reach: each group of query blocks against its band of
key blocks, gathered by shifting whole blocks) or `looped.py` (unbounded
reach: each query block over the key blocks its pattern allows, traced
bounds, an online softmax). `schedule.py` runs one plan (`attend`,
`attend_backward`): it picks the plan's schedule, transposes "BTHK" calls
once (both schedules work heads-first, `[B, H, T, K]`) and holds the plan's
custom VJP. `stride.py` is π's skips (one stride term, however many) as one
more piece beside the local part (`stride_attend`: shifted views of the keys
for a few skips, else one row call of the core over the keys viewed as
`[T / period, period]`), and `arrays.py` the windows, slices and in-place adds
they all share. This module is the backend (`BACKEND`): it sends a call to
its plan alone, or to the union of the local part and the stride, merged by
log-sum-exp under one custom VJP (explicit key positions, from decoding
caches, mask the skips in the loop instead). Every custom VJP (a plan's call,
the union, the stride piece alone) keeps only q, k, v, the starts, the
priors, the document ids, o and lse; the backward recomputes the
probabilities block by block (the flash-attention backward) and handles a
cotangent on lse. Document ids add one comparison per block of logits,
broadcast over the heads. Logits, softmax, lse and priors are float32; the
q.k and p.v matmuls run in the input dtype with float32 accumulation.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from efficient_lm.ops.core.call import Backend
from efficient_lm.ops.core.merge import merge
from efficient_lm.ops.core.plan import Plan, plan_for
from efficient_lm.ops.core.xla import stride
from efficient_lm.ops.core.xla.arrays import F32
from efficient_lm.ops.core.xla.schedule import attend, attend_backward, starts, traced_starts
from efficient_lm.ops.core.xla.stride import stride_attend


def _stride_apart(call) -> bool:
  """The call's skips run as the stride piece beside the local part (else they are masked in the
  loop over explicit key positions)."""
  return call.pattern.has_skips and not call.explicit


def _explicit(call, k_start):
  """A call with a traced key offset and skips back to the sequence start, as explicit key
  positions (the stride piece cannot place such keys on a static grid)."""
  return dataclasses.replace(call, explicit=True), jnp.asarray(k_start, jnp.int32) + jnp.arange(
      call.Tk, dtype=jnp.int32)


def _plan(call, q_start, k_start) -> Plan:
  return plan_for(call.pattern, call.Tq, call.Tk, q_start=q_start, k_start=k_start,
                  explicit=call.explicit, scale=call.scale, layout=call.layout)


def _backend_attend(call, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior,
                    q_segments, k_segments, *, interpret: bool = False):
  del interpret  # XLA needs no kernel interpreter
  if _stride_apart(call) and call.k_offset is None and call.pattern.skip_to is None:
    call, k_positions = _explicit(call, k_start)
  if not _stride_apart(call):
    return attend(_plan(call, q_start, k_start), q, k, v, q_start, k_start, k_positions,
                  local_prior, skip_prior, q_segments, k_segments)
  return _union(call, q, k, v, *traced_starts(call, q_start, k_start), local_prior, skip_prior,
                q_segments, k_segments)


# The local part and the stride as one custom VJP: residuals q, k, v, (starts), priors, document
# ids, and the union's o and lse (never the stride's column views, nor either part's o); the
# backward is `_backend_backward`, each part's flash backward at the union's o and lse.

def _union_forward(call, q, k, v, q_start, k_start, lp, sp, qseg, kseg):
  q_start, k_start = starts(call, q_start, k_start)
  local = attend(_plan(call, q_start, k_start), q, k, v, q_start, k_start, None, lp, None, qseg,
                 kseg)
  return merge([local, stride.forward(call, q, k, v, q_start, k_start, sp, qseg, kseg)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _union(call, q, k, v, q_start, k_start, lp, sp, qseg, kseg):
  return _union_forward(call, q, k, v, q_start, k_start, lp, sp, qseg, kseg)


def _union_fwd(call, q, k, v, q_start, k_start, lp, sp, qseg, kseg):
  o, lse = _union_forward(call, q, k, v, q_start, k_start, lp, sp, qseg, kseg)
  return (o, lse), (q, k, v, q_start, k_start, lp, sp, qseg, kseg, o, lse)


def _union_bwd(call, residuals, cotangents):
  q, k, v, q_start, k_start, lp, sp, qseg, kseg, o, lse = residuals
  do, dlse = cotangents
  dq, dk, dv, dlp, dsp = _backend_backward(call, q, k, v, *starts(call, q_start, k_start), None,
                                           lp, sp, qseg, kseg, o, lse, do, dlse.astype(F32))
  return dq, dk, dv, None, None, dlp, dsp, None, None


_union.defvjp(_union_fwd, _union_bwd)


def _backend_backward(call, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior,
                      q_segments, k_segments, o, lse, do, dlse, *, interpret: bool = False):
  del interpret
  if _stride_apart(call) and call.k_offset is None and call.pattern.skip_to is None:
    call, k_positions = _explicit(call, k_start)
  if not _stride_apart(call):
    return attend_backward(_plan(call, q_start, k_start), q, k, v, q_start, k_start, k_positions,
                           local_prior, skip_prior, q_segments, k_segments, o, lse, do, dlse)
  dq, dk, dv, dlp, _ = attend_backward(_plan(call, q_start, k_start), q, k, v, q_start, k_start,
                                       None, local_prior, None, q_segments, k_segments, o, lse, do,
                                       dlse)
  sq, sk, sv, dsp = stride.backward(call, q, k, v, q_start, k_start, skip_prior, q_segments,
                                    k_segments, o, lse, do, dlse)
  return dq + sq, dk + sk, dv + sv, dlp, dsp


BACKEND = Backend(name="xla", attend=_backend_attend, backward=_backend_backward,
                  doc="the blockwise loop core: every pattern, every platform, O(T) memory")


__all__ = ["BACKEND", "attend", "attend_backward", "stride_attend"]
