"""The one route from a mixer to attention: `attend(q, k, v, pattern, ...)` on a `Route`.

Every mixer of every model calls `route.attend` with the `Pattern` it states once, in every
mode; the mode follows from where the keys come from, never from which op the mixer picked:

- the whole sequence (k, v the queries' own positions): on one device the core
  (`ops.core.attend`); with the sequence sharded over a `context` mesh axis (`Route.mesh`),
  the ring chosen from the pattern (`ops.ring.attend`: a halo for bounded reach, ring
  attention with the zig-zag layout for dense);
- a sequence chunk (`q_start` traced, `k_offset` static: the chunk's key window starts that
  far before its queries; `q_align`: q_start is a multiple of it);
- a decoding step against a cache (`k_positions`: each slot's position, -1 = empty);
- a cross-attention (`q_start` static: Perceiver-AR's latents at the end of the stream).

The backend is `Route.impl` wherever it can run the call (kernels get static masks in every
mode: the chunk's and the halo's offsets, a ring step's three cases); elsewhere the registry
falls back to the XLA core with one log line (`ops.core.backends.choose`). Document ids
(`segment_ids` `[B, Tq]`, and `k_segment_ids` `[B, Tk]` when the keys are not the queries'
positions) confine every query to its own document, in every mode.
"""

import dataclasses

import jax
import jax.numpy as jnp

from efficient_lm.ops import core
from efficient_lm.ops import memory
from efficient_lm.ops import ring
from efficient_lm.ops.pattern import Pattern


@dataclasses.dataclass(frozen=True)
class Route:
  """Where a model's attention runs: the backend (`impl`, resolved: not 'auto'; `interpret`
  runs a kernel in Pallas interpret mode) and, when the sequence is sharded, the mesh with its
  `axis_name` of more than one device and the `layout` the sequence arrives in ('natural', or
  'zigzag' for dense ring attention: the training loop permutes the batch once and passes the
  matching positions)."""
  impl: str = "xla"
  interpret: bool = False
  mesh: jax.sharding.Mesh | None = None
  axis_name: str = "context"
  layout: str = "natural"

  def __post_init__(self):
    if self.mesh is not None and ring.num_devices(self.mesh, self.axis_name) < 2:
      raise ValueError(f"Route.mesh has {self.mesh.shape.get(self.axis_name, 1)} device(s) along "
                       f"{self.axis_name!r}: pass mesh=None for an unsharded sequence")
    if self.layout not in ring.LAYOUTS:
      raise ValueError(f"layout={self.layout!r} must be one of {ring.LAYOUTS}")

  @property
  def context(self) -> int:
    """Devices the sequence is sharded over (1: unsharded)."""
    return 1 if self.mesh is None else self.mesh.shape[self.axis_name]

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, pattern: Pattern, **kwargs
             ) -> jax.Array:
    """`attend(q, k, v, pattern, route=self, **kwargs)`."""
    return attend(q, k, v, pattern, route=self, **kwargs)

  def exponential_memory(self, s_BND: jax.Array, alpha, keep_BN: jax.Array | None = None
                         ) -> jax.Array:
    """`ops.memory.exponential_memory`, the blocks sharded like the sequence when it is."""
    if self.mesh is None:
      return memory.exponential_memory(s_BND, alpha, keep_BN)
    return ring.exponential_memory(s_BND, alpha, keep_BN, mesh=self.mesh, axis_name=self.axis_name)

  def shift_right(self, x_BT: jax.Array, distance: int) -> jax.Array:
    """x[:, i - distance] at position i (zeros before the start), sharded like the sequence."""
    if self.mesh is None:
      return shift_right(x_BT, distance)
    return ring.shift_right(x_BT, distance, mesh=self.mesh, axis_name=self.axis_name)

  def shifts_right(self, x_BT: jax.Array, count: int) -> tuple[jax.Array, ...]:
    """`shift_right` by 1, ..., count: with a mesh, one halo of `count` tokens from the devices
    behind (`ring.shifts_right`)."""
    if self.mesh is None:
      return tuple(shift_right(x_BT, j) for j in range(1, count + 1))
    return ring.shifts_right(x_BT, count, mesh=self.mesh, axis_name=self.axis_name)


def shift_right(x_BT: jax.Array, distance: int) -> jax.Array:
  """x[:, i - distance] at position i (zeros before the start): a strided slice, no gather."""
  T = x_BT.shape[1]
  pad = [(0, 0), (distance, 0)] + [(0, 0)] * (x_BT.ndim - 2)
  return jnp.pad(x_BT, pad)[:, :T]


DEFAULT = Route()


def attend(q: jax.Array, k: jax.Array, v: jax.Array, pattern: Pattern, *,
           route: Route = DEFAULT, q_start: int | jax.Array = 0, k_offset: int | None = None,
           q_align: int = 1, k_positions: jax.Array | None = None,
           local_prior: jax.Array | None = None, skip_prior: jax.Array | None = None,
           segment_ids: jax.Array | None = None, k_segment_ids: jax.Array | None = None,
           scale: float | None = None, layout: str = "BTHK") -> jax.Array:
  """Softmax attention of q over the keys `pattern` lets each query see: o in q's shape and dtype.

  q `[B, Tq, H, K]`, k / v `[B, Tk, H_kv, K]` (H_kv dividing H: grouped-query attention;
  "BHTK": heads first, a cache's layout). Queries
  at `q_start + arange(Tq)`; keys at the queries' positions (Tk = Tq, no offset), at
  `q_start + k_offset + arange(Tk)` (a chunk's window), or at `k_positions` (a cache). Priors
  `[B, Tq, H]` (π's log-gates) join the local / skip logits. `segment_ids` `[B, Tq]`: the
  queries' documents, and the keys' too unless `k_segment_ids` `[B, Tk]` is given.
  """
  if k_segment_ids is not None and segment_ids is None:
    raise ValueError("k_segment_ids needs segment_ids (the queries' document ids) too")
  t = 1 if layout == "BTHK" else 2
  whole = (k_positions is None and k_offset is None and q.shape[t] == k.shape[t]
           and isinstance(q_start, int) and q_start == 0 and k_segment_ids is None)
  if route.mesh is not None and whole:
    if layout != "BTHK":
      raise ValueError("a sharded sequence is attended in the BTHK layout")
    return ring.attend(q, k, v, pattern, mesh=route.mesh, axis_name=route.axis_name,
                       layout=route.layout, scale=scale, local_prior=local_prior,
                       skip_prior=skip_prior, segment_ids=segment_ids, impl=route.impl,
                       interpret=route.interpret)
  k_segments = segment_ids if k_segment_ids is None else k_segment_ids
  o, _ = core.attend(q, k, v, pattern, q_start=q_start, k_offset=k_offset, q_align=q_align,
                     k_positions=k_positions, scale=scale, local_prior=local_prior,
                     skip_prior=skip_prior, q_segments=segment_ids, k_segments=k_segments,
                     layout=layout, impl=route.impl, interpret=route.interpret, with_lse=False)
  return o
