"""The attention backends behind `ops.core.attend`, and how one is chosen.

Every attention call reaches one backend through the same front door
(`core.attend`): the call's static description (`Call`) and its arrays. A
backend says whether it can run a call (`unsupported(call)`: None, or why
not) and runs it (`attend`), returning `(o, lse)`, differentiable in q, k, v
and the priors under cotangents on both o and lse (so pieces still merge).

    xla        the blockwise loop core (`xla.py`): every pattern, every platform
    splash     TPU: jax's Pallas splash-attention kernels, masks from the `Pattern`
    gpu        GPU: cuDNN where the pattern is causal or a window, a Pallas kernel otherwise
    reference  the plain masked softmax over a `[Tq, Tk]` matrix: O(T^2), tests only

`model.attention_impl` names one (`auto` picks per platform: `AUTO`); the
training patterns of a model are checked against it before anything
compiles (`check_patterns`). A kernel backend needs its hardware, or Pallas
interpret mode (`interpret=True`, for tests on CPU). Calls a kernel cannot
express by their structure, not their pattern (decoding caches' explicit key
positions, ring steps whose key offset is traced) run on `xla`.
"""

import dataclasses
from typing import Callable

from efficient_lm.ops.pattern import Pattern

IMPLS = ("auto", "xla", "splash", "gpu", "reference")
ALIASES = {"flash": "xla", "cudnn": "gpu"}  # earlier names of the dense model's impls
AUTO = {"tpu": "splash", "gpu": "gpu"}      # per platform; anything else: xla


@dataclasses.dataclass(frozen=True)
class Call:
  """What is static about one attention call (hashable)."""
  pattern: Pattern
  scale: float
  Tq: int
  Tk: int
  q_start: int | None    # the static query start, None when traced
  k_start: int | None    # the static key start, None when traced
  k_offset: int | None   # k_start - q_start when static (also with traced starts), else None
  q_align: int           # q_start is known to be a multiple of this
  explicit: bool         # explicit key positions (decoding caches)
  local_prior: bool      # a local prior is given
  skip_prior: bool       # a skip prior is given
  layout: str            # "BTHK" or "BHTK" (q, k, v, o); priors and lse: [B, Tq, H] / [B, H, Tq]
  dtype: str             # q's dtype name
  with_lse: bool = True  # the caller uses lse (else a backend may return None for it)

  @property
  def q_phase(self) -> int | None:
    """q_start modulo the pattern's block size when static (0 without blocks), else None."""
    block = self.pattern.block_size
    if block is None:
      return 0
    if self.q_start is not None:
      return self.q_start % block
    return 0 if self.q_align % block == 0 else None


@dataclasses.dataclass(frozen=True)
class Backend:
  """One way to run `core.attend` calls (see the module docstring)."""
  name: str
  attend: Callable            # (call, q, k, v, q_start, k_start, k_positions, lp, sp, *,
                              #  interpret) -> (o, lse)
  unsupported: Callable[[Call], str | None] = lambda call: None
  pattern_unsupported: Callable[[Pattern], str | None] = lambda pattern: None
  platforms: tuple[str, ...] = ()  # a kernel's native platforms; () = runs everywhere
  doc: str = ""

  @property
  def kernel(self) -> bool:
    return bool(self.platforms)


_REGISTRY: dict[str, Backend] = {}
_loaded = False


def register(backend: Backend) -> Backend:
  _REGISTRY[backend.name] = backend
  return backend


def get(name: str) -> Backend:
  _load()
  name = ALIASES.get(name, name)
  if name not in _REGISTRY:
    raise ValueError(f"attention impl {name!r} is not one of {', '.join(IMPLS)}")
  return _REGISTRY[name]


def _load() -> None:
  """Imports the backend modules (each registers itself) on first use."""
  global _loaded
  if _loaded:
    return
  _loaded = True
  from efficient_lm.ops.core import gpu, reference, splash, xla  # noqa: F401  (each registers itself)


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
      able = [name for name in ("xla", "splash", "gpu", "reference")
              if get(name).pattern_unsupported(pattern) is None]
      return f"{reason}; use one of {', '.join(able)}"
  return None
