"""One plan's call of the XLA core: the schedule it names, its layout, its custom VJP.

`attend(plan, ...)` runs a `plan.Plan` on its schedule (`banded` or `looped`),
both heads-first: "BTHK" calls are transposed once here. The custom VJP keeps
only q, k, v, the starts, the key positions, the priors, the document ids, o
and lse; the backward (`attend_backward`, also callable at a given o and lse,
as ring steps and the stride's row call do) recomputes the probabilities
block by block and handles a cotangent on lse.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from efficient_lm.ops.core.plan import Plan
from efficient_lm.ops.core.xla import banded, looped
from efficient_lm.ops.core.xla.arrays import F32

# The custom VJP: residuals q, k, v, (starts, key positions), priors, o, lse.

def _forward(plan: Plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg):
  """(o in the plan's layout, lse `[B, H, Tq]`). Both schedules work heads-first: "BTHK" arrays
  are transposed here (O(T); measured faster on CPU than einsums over BTHK slabs)."""
  if plan.layout == "BTHK":
    o, lse = _forward(dataclasses.replace(plan, layout="BHTK"), *_swap(q, k, v), q_start, k_start,
                      k_pos, lp, sp, qseg, kseg)
    return jnp.swapaxes(o, 1, 2), lse
  if plan.schedule == "band":
    return banded.forward(plan, q, k, v, q_start, k_start, lp, sp, qseg, kseg)
  return looped.forward(plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg)


def _backward(plan: Plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg, o, lse, do, dlse):
  if plan.layout == "BTHK":
    q_, k_, v_, o_, do_ = _swap(q, k, v, o, do)
    grads = _backward(dataclasses.replace(plan, layout="BHTK"), q_, k_, v_, q_start, k_start,
                      k_pos, lp, sp, qseg, kseg, o_, lse, do_, dlse)
    return (*_swap(*grads[:3]), *grads[3:])
  if plan.schedule == "band":
    return banded.backward(plan, q, k, v, q_start, k_start, lp, sp, qseg, kseg, o, lse, do, dlse)
  return looped.backward(plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg, o, lse, do,
                         dlse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg):
  return _forward(plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg)


def _attend_fwd(plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg):
  o, lse = _forward(plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg)
  return (o, lse), (q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg, o, lse)


def _attend_bwd(plan, residuals, cotangents):
  q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg, o, lse = residuals
  do, dlse = cotangents
  dlse = dlse.astype(F32)
  dq, dk, dv, dlp, dsp = _backward(plan, q, k, v, q_start, k_start, k_pos, lp, sp, qseg, kseg, o,
                                   lse, do, dlse)
  return dq, dk, dv, None, None, None, dlp, dsp, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _swap(*xs):
  """BTHK <-> BHTK (axes 1 and 2) for every array given (None stays None)."""
  return tuple(None if x is None else jnp.swapaxes(x, 1, 2) for x in xs)


def _arg(start, static):
  return None if static is not None else jnp.asarray(start, jnp.int32)


def _args(plan: Plan, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior, qseg, kseg):
  """`_attend`'s arguments: traced starts only where the plan has no static one; priors float32
  heads-first (`[B, H, Tq]`)."""
  if plan.layout == "BTHK":
    local_prior, skip_prior = _swap(local_prior, skip_prior)
  priors = (None if p is None else p.astype(F32) for p in (local_prior, skip_prior))
  return (q, k, v, _arg(q_start, plan.q_start), _arg(k_start, plan.k_start), k_positions, *priors,
          qseg, kseg)


def attend(plan: Plan, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior,
           q_segments=None, k_segments=None):
  """(o in the plan's layout, lse in the priors' layout: `[B, Tq, H]` for "BTHK")."""
  o, lse = _attend(plan, *_args(plan, q, k, v, q_start, k_start, k_positions, local_prior,
                                skip_prior, q_segments, k_segments))
  return o, (jnp.swapaxes(lse, 1, 2) if plan.layout == "BTHK" else lse)


def attend_backward(plan: Plan, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior,
                    q_segments, k_segments, o, lse, do, dlse):
  """(dq, dk, dv, d local_prior, d skip_prior) of one call at the given o and lse (lse and dlse
  in the priors' layout)."""
  if plan.layout == "BTHK":
    lse, dlse = _swap(lse, dlse)
  residuals = (*_args(plan, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior,
                      q_segments, k_segments), o, lse.astype(F32))
  dq, dk, dv, _, _, _, dlp, dsp, _, _ = _attend_bwd(plan, residuals, (do, dlse))
  if plan.layout == "BTHK":
    dlp, dsp = _swap(dlp, dsp)
  return dq, dk, dv, dlp, dsp


# The starts of a call's custom VJPs (the stride piece's, the union's).

def traced_starts(call, q_start, k_start):
  """The starts the custom VJPs take: int32 scalars where the call's are traced, None where static
  (or not given: a static key offset places the keys)."""
  traced = lambda static, start: None if static is not None or start is None else jnp.asarray(
      start, jnp.int32)
  return traced(call.q_start, q_start), traced(call.k_start, k_start)


def starts(call, q_start, k_start):
  """The call's starts: its static ones where the custom VJP was given None."""
  return (call.q_start if q_start is None else q_start,
          call.k_start if k_start is None else k_start)
