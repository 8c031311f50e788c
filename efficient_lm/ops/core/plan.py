"""The plan of one attention call: which blocks of queries visit which blocks of keys.

`plan_for(pattern, Tq, Tk, ...)` picks one of the core's two block schedules
for a call (module `ops.core`): *banded* for a pattern of bounded reach
(block-local, sliding window, segments, π's local part: each query block sees
a fixed band of key blocks, vectorized over a group of about `GROUP_TOKENS`
query tokens) or *looped* for unbounded reach (dense causal, cross-attention,
ring steps, explicit key positions: each query block loops over the key
blocks `Pattern.key_range` allows). A plan covers the local part of π's
pattern only: its skips (one stride term) run beside it as one more piece
(`xla.stride_attend`: a shifted view of the keys per skip for a few, else one
call of the core over the keys viewed as `[T / period, period]`), except with
explicit key positions, where the loop masks them (`Pattern.skip_visible`).
The plan is static and hashable (the custom VJP's static argument); `xla/`
runs it (`xla/schedule.py`).
"""

import dataclasses

from efficient_lm.ops.pattern import Pattern
from efficient_lm.config.errors import is_int as is_static  # a static (Python int) start or size

MASKED = -1e30       # the logit of a key a query does not see
NO_KEY_LSE = -1e29   # lse of a row that sees no key: exp(MASKED - NO_KEY_LSE) == 0, merge weight 0

# Schedule sizes, tuned with experiments/bench_ops.py on a 2-core CPU.
Q_BLOCK = 512          # looped schedule: queries per block
K_BLOCK = 512          # looped schedule: keys per block
GROUP_TOKENS = 512     # banded schedule: query tokens processed together
MAX_BAND = 4096        # banded schedule: widest key band per query block (else looped) ...
MAX_BAND_TILE = 1 << 20  # ... and most logits per query block (L x band)
SINGLE_BLOCK = 1 << 22  # explicit key positions: one block while Tq * Tk is at most this

LAYOUTS = ("BTHK", "BHTK")


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def window_block(window: int) -> int:
  """Query block length of the banded schedule for a sliding window."""
  return max(16, min(512, window // 2))


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about one call (hashable: the custom VJP's static argument)."""
  pattern: Pattern
  scale: float
  Tq: int
  Tk: int
  q_start: int | None  # the static start, or None when it is a traced argument
  k_start: int | None
  explicit: bool       # explicit key positions
  schedule: str        # "band" or "loop"
  layout: str = "BHTK"  # the caller's q/k/v/o layout (both schedules compute heads-first)
  # Banded schedule.
  block: int = 0       # L: query block length (and key block length)
  align: int = 1       # the query grid starts at a multiple of this
  group: int = 1       # G: query blocks per group
  groups: int = 1      # groups
  back: int = 0        # key blocks before a query block's own
  fwd: int = 0         # key blocks after it
  front: int = 0       # key rows before the grid origin
  # Looped schedule.
  q_block: int = 0
  k_block: int = 0

  @property
  def key_rows(self) -> int:
    return self.front + (self.groups * self.group + self.fwd) * self.block


# Planning.

def _band_plan(pattern: Pattern, scale: float, Tq: int, Tk: int, q_start, k_start,
               layout: str) -> Plan | None:
  """The banded schedule for this call, or None when the local reach is unbounded or too wide."""
  local = pattern.local
  if local.window is None and local.block_size is None:
    return None
  if not local.causal and local.block_size is None:
    return None
  align = local.block_size or 1
  L = local.block_size if local.block_size is not None else window_block(local.window)
  static_q = is_static(q_start)
  phase = q_start % align if static_q else align - 1  # the worst case when traced
  L = max(1, min(L, phase + Tq))
  N = cdiv(phase + Tq, L)
  # Key extent of every query block: exact for static positions, the worst case over the
  # (unknown, align-multiple) grid origin otherwise.
  origin = q_start - phase if static_q else align * (10 ** 9 // align)
  back = fwd = 0
  for i in range(N):
    a = origin + i * L
    first, last = a, a + L - 1
    if static_q:
      first, last = max(first, q_start), min(last, q_start + Tq - 1)
    if first > last:
      continue
    lo, hi = local.key_range(first, last)
    if is_static(k_start) and static_q:
      lo, hi = max(lo, k_start), min(hi, k_start + Tk - 1)
    if lo > hi:
      continue
    back, fwd = max(back, a - lo), max(fwd, hi - (a + L - 1))
  nb_back, nb_fwd = cdiv(back, L), cdiv(fwd, L)
  band = (nb_back + nb_fwd + 1) * L
  if band > MAX_BAND or L * band > MAX_BAND_TILE:
    return None
  G = max(1, GROUP_TOKENS // L)
  groups = cdiv(N, G)
  G = cdiv(N, groups)
  return Plan(pattern=local, scale=scale, Tq=Tq, Tk=Tk,
               q_start=q_start if static_q else None,
               k_start=k_start if is_static(k_start) else None, explicit=False, schedule="band",
               layout=layout, block=L, align=align, group=G, groups=groups, back=nb_back, fwd=nb_fwd,
               front=nb_back * L)


def _loop_plan(pattern: Pattern, scale: float, Tq: int, Tk: int, q_start, k_start,
               explicit: bool, layout: str) -> Plan:
  if explicit and Tq * Tk <= SINGLE_BLOCK:
    Lq, Lk = Tq, Tk
  else:
    Lq, Lk = min(Q_BLOCK, Tq), min(K_BLOCK, Tk)
  return Plan(pattern=pattern, scale=scale, Tq=Tq, Tk=Tk,
               q_start=q_start if is_static(q_start) else None,
               k_start=k_start if is_static(k_start) else None, explicit=explicit,
               schedule="loop", layout=layout, q_block=Lq, k_block=Lk)


def plan_for(pattern: Pattern, Tq: int, Tk: int, *, q_start=0, k_start=0, explicit: bool = False,
             scale: float = 1.0, layout: str = "BTHK") -> Plan:
  """The schedule `attend` would use (exposed for tests and benchmarks): of the local part of a
  pattern with skips (the stride runs beside it), unless the key positions are explicit."""
  if not explicit:
    pattern = pattern.local
    band = _band_plan(pattern, scale, Tq, Tk, q_start, k_start, layout)
    if band is not None:
      return band
  return _loop_plan(pattern, scale, Tq, Tk, q_start, k_start, explicit, layout)
