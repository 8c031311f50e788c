"""Who sees whom: one description of every attention pattern in the library.

A query at position p sees a key at position j (negative positions are empty
cache slots or keys before the sequence start: never visible) when

- `causal`: j <= p;
- `window`: p - window < j;
- `block_size` (+ `lookback`): p // block_size - lookback <= j // block_size <= p // block_size;

all that apply (the *local* keys), or when j is one of π's periodic skip keys
(the *stride*): j = p - m * period for m = skip_from..skip_to (skip_to None:
back to the sequence start), each at least `window` back, so never a local key
too. The stride is one term whatever its count: the backends run it as one
piece (`core/xla/stride.py`'s `stride_attend`: a shifted view of the keys per skip for
a few, else keys `[T / period, period]`, a band along the row axis per column),
and ask the pattern for what they need through its methods (`has_skips`,
`skip_offsets`, `key_range`, `reach`, `local`) rather than reading its fields.
Positions are absolute: the core places queries at `q_start + arange(Tq)` and
keys at `k_start + arange(Tk)` or at explicit slot positions, so the
cross-attention offset, the ring steps and the decoding caches are all this one
rule. `Pattern` is frozen and hashable:
static under `jax.jit`.

Importing this module loads no jax: a family's config states its patterns (`families/`), and
`--help` and the config's checks read them before jax starts; only the methods on arrays use it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from efficient_lm.config.errors import is_int  # a Python int: static, never traced (plan.py too)

if TYPE_CHECKING:
  import jax

  Position = int | jax.Array


def _jnp():
  """jax.numpy, for the methods on (traced) arrays: imported on their first call, so that the
  patterns a config states are read without jax."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  return jnp


def _max(a: Position, b: Position) -> Position:
  return max(a, b) if isinstance(a, int) and isinstance(b, int) else _jnp().maximum(a, b)


def _min(a: Position, b: Position) -> Position:
  return min(a, b) if isinstance(a, int) and isinstance(b, int) else _jnp().minimum(a, b)


@dataclasses.dataclass(frozen=True)
class Pattern:
  """Which keys each query sees (see the module docstring); build one with the constructors."""
  causal: bool = True
  window: int | None = None
  block_size: int | None = None
  lookback: int = 0
  period: int | None = None    # the stride: skip keys at p - m * period ...
  skip_from: int = 1           # ... for m = skip_from ..
  skip_to: int | None = None   # .. skip_to (None: back to the sequence start)

  def __post_init__(self):
    if not isinstance(self.causal, bool):
      raise ValueError(f"Pattern.causal={self.causal!r} must be True or False")
    for name in ("window", "block_size", "period"):
      value = getattr(self, name)
      if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"Pattern.{name}={value!r} must be a positive integer or None")
    if not is_int(self.lookback) or self.lookback < 0:
      raise ValueError(f"Pattern.lookback={self.lookback!r} must be a non-negative integer")
    if not is_int(self.skip_from) or self.skip_from < 1:
      raise ValueError(f"Pattern.skip_from={self.skip_from!r} must be a positive integer")
    if self.skip_to is not None and (not is_int(self.skip_to) or self.skip_to < self.skip_from):
      raise ValueError(f"Pattern.skip_to={self.skip_to!r} must be an integer >= skip_from="
                       f"{self.skip_from}, or None (back to the sequence start)")
    if self.period is None:
      if self.skip_from != 1 or self.skip_to is not None:
        raise ValueError(f"Pattern.skip_from / skip_to need a period; set Pattern.period or "
                         "build the pattern with Pattern.pi(window, period, num_skips)")
      return
    if self.window is None or self.block_size is not None or not self.causal:
      raise ValueError(f"Pattern.period={self.period!r} (skips) needs a causal window pattern "
                       "(no blocks); build it with Pattern.pi(window, period, num_skips)")
    if self.skip_from * self.period < self.window:
      raise ValueError(f"Pattern.skip_from={self.skip_from} puts a skip ({self.skip_from} * "
                       f"{self.period}) inside window={self.window}, where it is a local key; "
                       "build the pattern with Pattern.pi(window, period, num_skips)")

  # Constructors.

  @classmethod
  def dense(cls) -> "Pattern":
    """Causal: every key j <= p."""
    return cls()

  @classmethod
  def sliding(cls, window: int) -> "Pattern":
    """Causal window: p - window < j <= p."""
    return cls(window=window)

  @classmethod
  def blocks(cls, block_size: int, lookback: int = 0) -> "Pattern":
    """Causal inside blocks of `block_size`, plus the `lookback` blocks before (ECP: lookback 1)."""
    return cls(block_size=block_size, lookback=lookback)

  @classmethod
  def segments(cls, length: int) -> "Pattern":
    """Bidirectional inside disjoint segments of `length` (Perceiver-AR's refined history)."""
    return cls(causal=False, block_size=length)

  @classmethod
  def pi(cls, window: int, period: int, num_skips: int | None,
         seq_len: int | None = None) -> "Pattern":
    """π-Attention: the causal window plus the skips m * period, m = 1..num_skips, as one stride
    (num_skips None: every period-th token back to the sequence start).

    Skips inside the window (m * period < window) are local keys already; with
    `seq_len`, skips that never land (m * period >= seq_len) are dropped.
    """
    if not is_int(period) or period < 1:
      raise ValueError(f"period={period!r} must be a positive integer")
    if num_skips is not None and (not is_int(num_skips) or num_skips < 0):
      raise ValueError(f"num_skips={num_skips!r} must be a non-negative integer or None")
    if not is_int(window) or window < 1:
      raise ValueError(f"window={window!r} must be a positive integer")
    first = max(1, -(-window // period))
    last = num_skips
    if seq_len is not None:
      last = (seq_len - 1) // period if last is None else min(last, (seq_len - 1) // period)
    if last is not None and last < first:
      return cls(window=window)
    return cls(window=window, period=period, skip_from=first, skip_to=last)

  # What the backends ask.

  @property
  def has_skips(self) -> bool:
    """Whether the pattern has skip keys (a stride)."""
    return self.period is not None

  @property
  def local(self) -> "Pattern":
    """The same pattern without its skips."""
    return dataclasses.replace(self, period=None, skip_from=1, skip_to=None)

  def skip_offsets(self, seq_len: int | None = None) -> tuple[int, ...]:
    """The skip distances p - j, increasing (those below `seq_len` when given: the ones that can
    land). An unbounded stride needs `seq_len`."""
    if self.period is None:
      return ()
    last = self.skip_to
    if seq_len is not None:
      last = (seq_len - 1) // self.period if last is None else min(last, (seq_len - 1) // self.period)
    if last is None:
      raise ValueError(f"{self} skips back to the sequence start: pass seq_len to skip_offsets")
    return tuple(m * self.period for m in range(self.skip_from, last + 1))

  # Visibility, on broadcasting integer arrays (traced values are fine).

  def local_visible(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    jnp = _jnp()
    q_pos, k_pos = jnp.asarray(q_pos), jnp.asarray(k_pos)
    seen = k_pos >= 0
    if self.causal:
      seen &= k_pos <= q_pos
    if self.window is not None:
      seen &= k_pos > q_pos - self.window
    if self.block_size is not None:
      q_block, k_block = q_pos // self.block_size, k_pos // self.block_size
      seen &= (k_block >= q_block - self.lookback) & (k_block <= q_block)
    return seen

  def skip_visible(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """The skip keys: p - j a multiple m * period with skip_from <= m <= skip_to (O(1) ops)."""
    jnp = _jnp()
    q_pos, k_pos = jnp.asarray(q_pos), jnp.asarray(k_pos)
    if self.period is None:
      return jnp.zeros(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), bool)
    d = q_pos - k_pos
    seen = (k_pos >= 0) & (d >= self.skip_from * self.period) & (d % self.period == 0)
    if self.skip_to is not None:
      seen &= d <= self.skip_to * self.period
    return seen

  def visible(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    seen = self.local_visible(q_pos, k_pos)
    return seen | self.skip_visible(q_pos, k_pos) if self.has_skips else seen

  # Extents.

  @property
  def reach(self) -> int | None:
    """The farthest p - j any query sees (None: unbounded: dense attention, or skips back to the
    sequence start)."""
    local = None
    if self.window is not None:
      local = self.window - 1
    if self.block_size is not None:
      blocks = (self.lookback + 1) * self.block_size - 1
      local = blocks if local is None else min(local, blocks)
    if self.has_skips:
      return None if self.skip_to is None else max(local, self.skip_to * self.period)
    return local

  def span(self, max_len: int) -> int:
    """Decoding-cache slots: every key a later query can still see (`max_len` bounds dense)."""
    return max_len if self.reach is None else min(max_len, self.reach + 1)

  def key_range(self, q_first: Position, q_last: Position) -> tuple[Position, Position | None]:
    """(lowest, highest) key position any query in [q_first, q_last] sees; highest None when
    unbounded (not causal, no blocks). Ints in, ints out; traced in, traced out."""
    lo = 0
    if self.window is not None:
      lo = _max(lo, q_first - self.window + 1)
    if self.block_size is not None:
      lo = _max(lo, (q_first // self.block_size - self.lookback) * self.block_size)
    if self.has_skips:
      lo = 0 if self.skip_to is None else _max(0, q_first - self.skip_to * self.period)
    hi = None
    if self.causal:
      hi = q_last
    if self.block_size is not None:
      block_end = (q_last // self.block_size + 1) * self.block_size - 1
      hi = block_end if hi is None else _min(hi, block_end)
    return lo, hi
