"""The attention backends behind `ops.core.attend`, and how one is chosen.

Every attention call reaches one backend through the same front door
(`core.attend`): the call's static description (`call.Call`) and its arrays.

    xla        the blockwise loop core (`xla.py`): every pattern, every platform
    splash     TPU: jax's Pallas splash-attention kernels, masks from the `Pattern`
    gpu        GPU: cuDNN where the call fits it, a Pallas (Triton) kernel otherwise
    reference  the plain masked softmax over a `[Tq, Tk]` matrix: O(T^2), tests only

`model.attention_impl` names one (`auto` picks per platform: `AUTO`); the
training patterns of a model are checked against it before anything
compiles (`check_patterns`). A kernel backend needs its hardware, or Pallas
interpret mode (`interpret=True`, for tests on CPU). A call a kernel cannot
run (`Backend.unsupported`: a decoding cache's explicit key positions, say)
runs on `xla`: `fallback` records it (`FALLBACKS`, what a compile reports)
and logs the reason once. The table below is static; a backend module is
imported on first use and imports only the types (`call.py`).
"""

import collections
import importlib
import logging

from efficient_lm.ops.core.call import Backend, Call
from efficient_lm.ops.pattern import Pattern

IMPLS = ("auto", "xla", "splash", "gpu", "reference")
ALIASES = {"flash": "xla", "cudnn": "gpu"}  # earlier names of the dense model's impls
AUTO = {"tpu": "splash", "gpu": "gpu"}      # per platform; anything else: xla
_MODULES = {name: f"efficient_lm.ops.core.{name}" for name in ("xla", "splash", "gpu", "reference")}

log = logging.getLogger(__name__)
# Calls a kernel backend handed to xla, traced so far: {(backend, reason): count}; and the kernel
# calls traced so far, {(backend, what: the kernel and its tiles): count}. A compile report reads
# both (reset them before tracing).
FALLBACKS: collections.Counter = collections.Counter()
KERNEL_CALLS: collections.Counter = collections.Counter()


def get(name: str) -> Backend:
  """The backend `name` (or an earlier alias), its module imported on first use."""
  name = ALIASES.get(name, name)
  if name not in _MODULES:
    raise ValueError(f"attention impl {name!r} is not one of {', '.join(IMPLS)}")
  return importlib.import_module(_MODULES[name]).BACKEND


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


def check_patterns(impl: str, platform: str, patterns: list[Pattern]) -> str | None:
  """Why `impl` cannot express one of `patterns` (None if it can), naming the impls that can."""
  backend = get(resolve(impl, platform))
  for pattern in patterns:
    reason = backend.pattern_unsupported(pattern)
    if reason is not None:
      able = [name for name in _MODULES if get(name).pattern_unsupported(pattern) is None]
      return f"{reason}; use one of {', '.join(able)}"
  return None


def choose(impl: str, call: Call) -> Backend:
  """The backend that runs `call` when `impl` is asked for: `impl`, or `xla` when it cannot
  (recorded in `FALLBACKS`, logged once per reason)."""
  backend = get(impl)
  reason = backend.unsupported(call)
  if reason is None:
    return backend
  if not FALLBACKS[(backend.name, reason)]:
    log.info("attention on xla instead of %s for this call: %s", backend.name, reason)
  FALLBACKS[(backend.name, reason)] += 1
  return get("xla")


__all__ = ["ALIASES", "AUTO", "Backend", "Call", "FALLBACKS", "IMPLS", "KERNEL_CALLS", "canonical", "check",
           "check_patterns", "choose", "get", "resolve"]
