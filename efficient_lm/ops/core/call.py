"""What a backend is given and what it must do: `Call` (the static description of one attention
call) and `Backend` (how to run calls), and the two counters of what the traced calls ran on
(`KERNEL_CALLS`, bumped by the kernel backends; `FALLBACKS`, by `backends.fallback`). The
backends import this module, the registry (`backends.py`) imports them, so nothing here imports
either.
"""

import collections
import dataclasses
from typing import Callable

from efficient_lm.ops.pattern import Pattern

# Calls a kernel backend handed to xla, traced so far: {(backend, reason): count}; and the kernel
# calls traced so far, {(backend, what: the kernel and its tiles): count}. A compile report reads
# both (reset them before tracing); `backends.recorded` reads their growth.
FALLBACKS: collections.Counter = collections.Counter()
KERNEL_CALLS: collections.Counter = collections.Counter()


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
  segments: bool = False  # document ids are given: a query sees only keys of its own document

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
  """One way to run `core.attend` calls.

  `attend(call, q, k, v, q_start, k_start, k_positions, local_prior, skip_prior, q_segments,
  k_segments, *, interpret) -> (o, lse)`, differentiable in q, k, v and the priors under
  cotangents on both o and lse (so pieces still merge). `backward(call, ..., o, lse, do, dlse,
  *, interpret) -> (dq, dk, dv, d local_prior, d skip_prior)` is the same call's gradient at a
  given o and lse (those of a union of key sets: a ring step), asked only for calls without
  priors or skips; None when the backend has none (the XLA core's serves those and these).
  `unsupported(call)`: None, or why not (the front door then runs `xla` and logs the reason
  once).
  """
  name: str
  attend: Callable
  backward: Callable | None = None
  unsupported: Callable[[Call], str | None] = lambda call: None
  pattern_unsupported: Callable[[Pattern], str | None] = lambda pattern: None
  platforms: tuple[str, ...] = ()  # a kernel's native platforms; () = runs everywhere
  doc: str = ""

  @property
  def kernel(self) -> bool:
    return bool(self.platforms)
