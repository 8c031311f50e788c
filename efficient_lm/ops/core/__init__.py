"""One attention for every attention in the library: `attend(q, k, v, pattern, ...)` -> (o, lse).

The softmax attention of each query over the keys `pattern` lets it see, and
the log-sum-exp of its logits. Queries sit at positions `q_start +
arange(Tq)`, keys at `k_start + arange(Tk)` (or `q_start + k_offset + ...`)
or at explicit `k_positions` (decoding caches: slot positions, -1 = empty);
the starts may be traced scalars. With document ids (`q_segments`,
`k_segments`) a query sees only keys of its own document. `merge` combines
attentions over disjoint key sets (ring steps, pieces) into the one over
their union.

    plan.py      the plan: the pattern cut into blocks (the XLA core's schedules)
    heads.py     grouped-query attention: k / v with fewer heads, the queries grouped per head
    call.py      what a backend is given (`Call`), what it provides (`Backend`), the counters
    backends.py  the backends behind `attend` and how one is chosen (`impl=`)
    xla/         the blockwise loop core, every platform (the default)
    splash.py    TPU: Pallas splash-attention kernels
    gpu.py       GPU: cuDNN (`cudnn.py`) and a Pallas kernel
    reference.py the plain masked softmax (tests)
    skips.py     π's skip keys beside a kernel's local part, merged by log-sum-exp
    merge.py     attentions over disjoint key sets -> over their union (log-sum-exp)

Memory: O(T) on every backend but `reference`. Logits, softmax, lse and
priors are float32 whatever the input dtype. See docs/architecture.md,
"Attention core".
"""


import jax
import jax.numpy as jnp

from efficient_lm.ops import precision
from efficient_lm.ops.core import backends
from efficient_lm.ops.core.backends import FALLBACKS, IMPLS
from efficient_lm.ops.core.call import Call
from efficient_lm.ops.core.merge import merge
from efficient_lm.ops.core.plan import LAYOUTS, MASKED, NO_KEY_LSE, Plan, is_static, plan_for
from efficient_lm.ops.pattern import Pattern

F32 = jnp.float32


def _check(q, k, v, layout, k_positions, local_prior, skip_prior, pattern, q_segments=None,
           k_segments=None):
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
  if not isinstance(pattern, Pattern):
    raise ValueError(f"pattern={pattern!r} must be an ops.pattern.Pattern (e.g. Pattern.dense())")
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be rank 4 ({layout}); got shapes {q.shape}, {k.shape}, {v.shape}")
  t = 1 if layout == "BTHK" else 2
  h = 3 - t
  if k.shape[:3] != v.shape[:3] or k.shape[-1] != q.shape[-1] or k.shape[0] != q.shape[0] \
      or not 0 < k.shape[h] <= q.shape[h] or q.shape[h] % k.shape[h]:
    raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} ({layout}) disagree: k and v need "
                     "q's batch and (k) head width, one length, and a number of heads dividing "
                     "q's (grouped-query attention)")
  rows = (q.shape[0], q.shape[1], q.shape[2])
  for name, prior in (("local_prior", local_prior), ("skip_prior", skip_prior)):
    if prior is not None and tuple(prior.shape) != rows:
      raise ValueError(f"{name} has shape {tuple(prior.shape)}; it must be {rows} (q's "
                       f"{'[B, Tq, H]' if layout == 'BTHK' else '[B, H, Tq]'}, like lse)")
  if k_positions is not None and tuple(k_positions.shape) != (k.shape[t],):
    raise ValueError(f"k_positions has shape {tuple(k_positions.shape)}; it must be "
                     f"({k.shape[t]},): one position per key slot (-1 = empty)")
  if (q_segments is None) != (k_segments is None):
    raise ValueError("pass both q_segments and k_segments (document ids of the queries and the "
                     "keys) or neither")
  if q_segments is not None:
    for name, ids, length in (("q_segments", q_segments, q.shape[t]),
                              ("k_segments", k_segments, k.shape[t])):
      if tuple(ids.shape) != (q.shape[0], length) or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} has shape {tuple(ids.shape)} and dtype {ids.dtype}; it must be "
                         f"integer ({q.shape[0]}, {length}): one document id per batch row and token")


def attend(q: jax.Array, k: jax.Array, v: jax.Array, pattern: Pattern, *,
           q_start: int | jax.Array = 0, k_start: int | jax.Array = 0,
           k_offset: int | None = None, q_align: int = 1,
           k_positions: jax.Array | None = None, scale: float | None = None,
           local_prior: jax.Array | None = None, skip_prior: jax.Array | None = None,
           q_segments: jax.Array | None = None, k_segments: jax.Array | None = None,
           layout: str = "BTHK", impl: str = "xla", interpret: bool = False,
           with_lse: bool = True) -> tuple[jax.Array, jax.Array | None]:
  """Softmax attention of q over the keys `pattern` lets each query see: (o, lse).

  q `[B, Tq, H, K]`, k/v `[B, Tk, H_kv, K]` (layout "BTHK"; "BHTK" is heads-first
  `[B, H, T, K]`, the decoding caches' layout, read in place). H_kv divides H: grouped-query
  attention, query head h reading key/value head h // (H / H_kv) (`heads.py`). Queries sit at
  `q_start + arange(Tq)`, keys at `k_start + arange(Tk)`, or at `q_start +
  k_offset + arange(Tk)` when the static `k_offset` is given (a chunk's key
  window at a traced start: what lets a kernel build its mask), or at
  `k_positions` `[Tk]` (-1 = an empty slot). `q_align`: q_start is known to be
  a multiple of it. `local_prior` / `skip_prior` (float32, lse's shape:
  `[B, Tq, H]` for "BTHK", `[B, H, Tq]` for "BHTK") are added to every local /
  skip logit of their row: one softmax over the union. `q_segments` `[B, Tq]` and
  `k_segments` `[B, Tk]` (integer document ids, both or neither): a query sees
  a key only when their ids are equal. Returns o in q's dtype
  and lse float32 (`[B, Tq, H]` or `[B, H, Tq]`); a row that sees no key has
  o = 0 and lse = `NO_KEY_LSE`, which `merge` weights 0.

  `impl` is the backend (`backends.IMPLS`, not `auto`: resolve it first with
  `backends.resolve`); a kernel backend runs off its hardware only with
  `interpret=True`. A call a kernel cannot express by its structure runs on
  `xla` (`backends.choose`: recorded in `backends.FALLBACKS`, logged once).
  `with_lse=False`: the caller needs only o (lse is
  returned as None), which lets a backend use a kernel without an lse output.
  """
  _check(q, k, v, layout, k_positions, local_prior, skip_prior, pattern, q_segments, k_segments)
  call, q_start, k_start = _call(q, k, pattern, scale, q_start, k_start, k_offset, q_align,
                                 k_positions, local_prior, skip_prior, q_segments, layout,
                                 with_lse)
  if call.Tq == 0 or call.Tk == 0:
    t = 1 if layout == "BTHK" else 2
    B, H = q.shape[0], q.shape[3 - t]
    o_shape = list(q.shape[:3]) + [v.shape[-1]]
    lse = jnp.full((B, call.Tq, H) if layout == "BTHK" else (B, H, call.Tq), NO_KEY_LSE, F32)
    return jnp.zeros(o_shape, q.dtype), (lse if with_lse else None)
  backend = _backend(impl, interpret, call)
  o, lse = backend.attend(call, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior,
                          _ids(q_segments), _ids(k_segments), interpret=interpret)
  return o, (lse if with_lse else None)


def _call(q, k, pattern, scale, q_start, k_start, k_offset, q_align, k_positions, local_prior,
          skip_prior, q_segments, layout, with_lse=True) -> tuple[Call, int | jax.Array,
                                                                  int | jax.Array]:
  """(the `Call` that `attend` / `attend_backward` describes, q_start, k_start): k_start from
  k_offset when that is given, k_offset from the starts when both are static."""
  scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
  q_start, k_start = _start("q_start", q_start), _start("k_start", k_start)
  if k_offset is not None:
    if not (is_static(k_offset) and is_static(k_start) and k_start == 0):
      raise ValueError(f"k_offset={k_offset!r} must be an integer, given instead of k_start")
    k_start = q_start + k_offset if is_static(q_start) else q_start + jnp.int32(k_offset)
  elif is_static(q_start) and is_static(k_start):
    k_offset = k_start - q_start
  t = 1 if layout == "BTHK" else 2
  call = Call(pattern=pattern, scale=scale, Tq=q.shape[t], Tk=k.shape[t],
              q_start=q_start if is_static(q_start) else None,
              k_start=k_start if is_static(k_start) else None, k_offset=k_offset,
              q_align=1 if is_static(q_start) else q_align,
              explicit=k_positions is not None, local_prior=local_prior is not None,
              skip_prior=skip_prior is not None, layout=layout, dtype=jnp.dtype(q.dtype).name,
              with_lse=with_lse, segments=q_segments is not None)
  return call, q_start, k_start


def _backend(impl: str, interpret: bool, call: Call):
  """The backend for `call`: `impl` (checked against the platform being compiled for), or `xla`."""
  backend = backends.get(impl)
  if backend.kernel and not interpret:
    problem = backends.check(backend.name, precision.platform(), interpret)
    if problem is not None:
      raise ValueError(f"impl={backend.name!r}: {problem}")
  return backends.choose(backend.name, call)


def _ids(segments: jax.Array | None) -> jax.Array | None:
  return None if segments is None else segments.astype(jnp.int32)


def attend_backward(q: jax.Array, k: jax.Array, v: jax.Array, pattern: Pattern, o: jax.Array,
                    lse: jax.Array, do: jax.Array, dlse: jax.Array | None = None, *,
                    q_start: int | jax.Array = 0, k_start: int | jax.Array = 0,
                    k_offset: int | None = None, q_align: int = 1,
                    k_positions: jax.Array | None = None, scale: float | None = None,
                    local_prior: jax.Array | None = None, skip_prior: jax.Array | None = None,
                    q_segments: jax.Array | None = None, k_segments: jax.Array | None = None,
                    layout: str = "BTHK", impl: str = "xla",
                    interpret: bool = False) -> tuple[jax.Array, ...]:
  """The flash backward of one `attend` call, given the o and lse to differentiate at: on the
  backend `impl` when it has a backward and can run the call, else on the XLA core.

  Returns (dq, dk, dv, d local_prior, d skip_prior) (None for absent priors).
  With the o and lse of the attention over a *union* of key sets (e.g. a whole
  ring after `merge`) and that attention's cotangent `do`, this gives the
  exact contribution of this call's keys: the probabilities exp(s - lse) are
  the union's. That is how a ring backward runs piece by piece.
  """
  _check(q, k, v, layout, k_positions, local_prior, skip_prior, pattern, q_segments, k_segments)
  call, q_start, k_start = _call(q, k, pattern, scale, q_start, k_start, k_offset, q_align,
                                 k_positions, local_prior, skip_prior, q_segments, layout)
  if dlse is None:
    dlse = jnp.zeros(lse.shape, F32)
  backend = _backend(impl, interpret, call)
  if backend.backward is None:
    backend = backends.fallback(backend.name, "no backward at a given o and lse")
  elif backend.kernel and (call.pattern.has_skips or call.local_prior or call.skip_prior):
    # A kernel's backward runs the local part alone: no priors, no skips.
    backend = backends.fallback(backend.name, "a backward with π's skips or priors (ring steps): "
                                "the kernel's backward takes the local part alone")
  return backend.backward(call, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior,
                          _ids(q_segments), _ids(k_segments), o, lse, do, dlse,
                          interpret=interpret)


def _start(name: str, start):
  if is_static(start) or isinstance(start, jax.Array):
    return start
  try:
    return int(start)
  except TypeError:
    raise ValueError(f"{name}={start!r} must be an integer or an integer scalar array") from None


__all__ = ["FALLBACKS", "IMPLS", "LAYOUTS", "MASKED", "NO_KEY_LSE", "Call", "Plan", "attend",
           "attend_backward", "backends", "merge", "plan_for"]
