"""The attention backends behind `ops.core.attend`, and how one is chosen.

Every attention call reaches one backend through the same front door
(`core.attend`): the call's static description (`call.Call`) and its arrays.

    xla        the blockwise loop core (`xla/`): every pattern, every platform
    splash     TPU: jax's Pallas splash-attention kernels, masks from the `Pattern`
    gpu        GPU: cuDNN where the call fits it, a Pallas (Triton) kernel otherwise
    reference  the plain masked softmax over a `[Tq, Tk]` matrix: O(T^2), tests only

`model.attention_impl` names one (`auto` picks per platform: `AUTO`); the
training patterns of a model are checked against it before anything
compiles (`check_patterns`). A kernel backend needs its hardware, or Pallas
interpret mode (`interpret=True`, for tests on CPU). A call a kernel cannot
run (`Backend.unsupported`: a decoding cache's explicit key positions, say),
and a kernel's backward of a call with π's skips or priors (`core.attend_backward`,
ring steps), run on `xla`: `fallback` records each (`FALLBACKS`, kept with
`KERNEL_CALLS` in `call.py` and re-exported here: what a compile and a
generation report, `recorded` / `report_line`) and logs the reason once.

The table below is static. A backend module is imported on first use, by
`get` (a plain import inside that one function: the kernel modules pull in
Pallas only when asked for); a backend module imports the types and the
counters (`call.py`), never this registry, so the import graph has no circle
(tests/test_imports.py checks it).
"""

import contextlib
import logging

import jax

from efficient_lm.runtime import jax_compat
from efficient_lm.ops.core import reference
from efficient_lm.ops.core import xla
from efficient_lm.ops.core.call import FALLBACKS, KERNEL_CALLS, Backend, Call
from efficient_lm.ops.pattern import Pattern

IMPLS = ("auto", "xla", "splash", "gpu", "reference")
ALIASES = {"flash": "xla", "cudnn": "gpu"}  # earlier names of the dense model's impls
AUTO = {"tpu": "splash", "gpu": "gpu"}      # per platform; anything else: xla
_NAMES = ("xla", "splash", "gpu", "reference")

log = logging.getLogger(__name__)
_WARNED: set[str] = set()  # the problems `check_installed` has warned of


def get(name: str) -> Backend:
  """The backend `name` (or an earlier alias); an accelerator kernel's module imported on first use."""
  # pylint: disable=import-outside-toplevel
  name = ALIASES.get(name, name)
  if name == "xla":
    return xla.BACKEND
  if name == "reference":
    return reference.BACKEND
  if name == "splash":
    # Imported here: Mosaic TPU's splash attention loads only for a model that asks for it.
    from efficient_lm.ops.core import splash as module
  elif name == "gpu":
    # Imported here: the Triton and cuDNN kernels load only for a model that asks for them.
    from efficient_lm.ops.core import gpu as module
  else:
    raise ValueError(f"attention impl {name!r} is not one of {', '.join(IMPLS)}")
  return module.BACKEND


def canonical(impl: str) -> str:
  """`impl` with the earlier names (`flash`, `cudnn`) mapped to today's."""
  return ALIASES.get(impl, impl)


def resolve(impl: str, platform: str) -> str:
  """The backend `impl` means on `platform` ('cpu', 'gpu', 'tpu'): `auto` picks one."""
  impl = canonical(impl)
  if impl == "auto":
    return AUTO.get(platform, "xla")
  return impl


def check(impl: str, platform: str, interpret: bool) -> str | None:
  """Why `impl` cannot run on `platform` (None if it can): a kernel off its hardware runs only
  interpreted."""
  backend = get(resolve(impl, platform))
  if backend.kernel and platform not in backend.platforms and not interpret:
    return (f"the {backend.name!r} kernels need a {' or '.join(backend.platforms).upper()} "
            f"(this platform is {platform!r}); use 'xla' (or 'auto'), or Pallas interpret mode "
            "(model.kernel_interpret=True, interpret=True for an op: slow, for tests)")
  return None


def check_installed(impl: str, platform: str) -> str | None:
  """Why the kernels `impl` names cannot be called on the installed jax (every call would run on
  `xla`), or None. `auto` is not refused: it warns once and runs on `xla`."""
  name = resolve(impl, platform)
  missing = jax_compat.splash_missing() if name == "splash" else None
  if missing is None:
    return None
  if canonical(impl) == "auto":
    if missing not in _WARNED:
      _WARNED.add(missing)
      log.warning("model.attention_impl='auto' means %r here, whose kernels this jax lacks: every "
                  "attention call runs on xla (%s)", name, missing)
    return None
  return missing


def check_patterns(impl: str, platform: str, patterns: list[Pattern]) -> str | None:
  """Why `impl` cannot express one of `patterns` (None if it can), naming the impls that can."""
  backend = get(resolve(impl, platform))
  for pattern in patterns:
    reason = backend.pattern_unsupported(pattern)
    if reason is not None:
      able = [name for name in _NAMES if get(name).pattern_unsupported(pattern) is None]
      return f"{reason}; use one of {', '.join(able)}"
  return None


def choose(impl: str, call: Call) -> Backend:
  """The backend that runs `call` when `impl` is asked for: `impl`, or `xla` when it cannot
  (recorded in `FALLBACKS`, logged once per reason)."""
  backend = get(impl)
  reason = backend.unsupported(call)
  return backend if reason is None else fallback(backend.name, reason)


def fallback(name: str, reason: str) -> Backend:
  """The `xla` backend for a call the backend `name` cannot run, for `reason`: every route from
  a kernel to the XLA core goes through here (counted in `FALLBACKS`, logged once per reason)."""
  if name == "xla":
    return get("xla")
  if not FALLBACKS[(name, reason)]:
    log.info("attention on xla instead of %s for this call: %s", name, reason)
  FALLBACKS[(name, reason)] += 1
  return get("xla")


@contextlib.contextmanager
def recorded():
  """What the attention calls traced inside the block ran on: yields a dict that holds, at exit,
  `kernel_calls` {(backend, kernel and tiles): calls} and `fallbacks` {(backend, reason): calls}
  (the counters' growth: a jitted function already traced adds nothing; see `trace_record`)."""
  kernels, fallbacks = KERNEL_CALLS.copy(), FALLBACKS.copy()
  out = {}
  try:
    yield out
  finally:
    out["kernel_calls"] = dict(KERNEL_CALLS - kernels)
    out["fallbacks"] = dict(FALLBACKS - fallbacks)


def trace_record(fn, *args, **kwargs) -> dict:
  """`recorded` of one fresh trace of `fn(*args, **kwargs)` (abstract: nothing runs or compiles;
  arrays or `jax.ShapeDtypeStruct`s)."""
  with recorded() as record:
    jax.eval_shape(lambda *a, **k: fn(*a, **k), *args, **kwargs)
  return record


def report_line(record: dict, label: str) -> str:
  """One line of a `recorded` dict, like the compile report's: "attention (label): N kernel
  calls (backend: kernel x n), M on xla instead (backend: reason x n)"."""
  kernels = ", ".join(f"{b}: {what} x{n}" for (b, what), n in sorted(record["kernel_calls"].items()))
  why = "; ".join(f"{b}: {reason} x{n}" for (b, reason), n in sorted(record["fallbacks"].items()))
  return (f"attention ({label}): {sum(record['kernel_calls'].values())} kernel calls"
          f"{f' ({kernels})' if kernels else ''}, {sum(record['fallbacks'].values())} on xla "
          f"instead of a kernel{f' ({why})' if why else ''}")


__all__ = ["ALIASES", "AUTO", "Backend", "Call", "FALLBACKS", "IMPLS", "KERNEL_CALLS", "canonical", "check",
           "check_installed", "check_patterns", "choose", "fallback", "get", "recorded", "report_line", "resolve",
           "trace_record"]
