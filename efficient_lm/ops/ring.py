"""Context parallelism: attention and the sequence-wide ops with T sharded over a mesh axis
(docs/architecture.md, "Context parallelism").

Each function takes and returns *global* arrays whose T axis is sharded over
`mesh.shape[axis_name]` devices (T divisible by them) and equals its single-device twin.
No device gathers the whole sequence.

- `attend(q, k, v, pattern, ...)`: self-attention of the sharded sequence, the ring chosen from
  the pattern. A pattern of bounded reach (windows, blocks, π's skips) fetches a halo of
  `reach` keys from the devices behind and runs one core call per device; dense causal
  attention is ring attention proper: keys and values travel around the ring, each step one
  core call per (query piece, key piece) merged by log-sum-exp, with a hand-written backward
  that rotates them again (`layout='zigzag'`, the batch permuted once by `to_layout` /
  `permute_batch`, balances the work). Every step runs on the backend `impl` (its kernels get
  static masks: the halo's offset, or one of three cases of a ring step), document ids travel
  with the keys.
- `exponential_memory`: the devices' (numerator, denominator) totals combined by a log-step
  prefix scan (restarting at documents).
- `shift_right`: the sharded `route.shift_right`.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from efficient_lm.ops import core
from efficient_lm.ops import memory
from efficient_lm.ops.core import kernel_mesh
from efficient_lm.ops.pattern import Pattern

LAYOUTS = ("natural", "zigzag")


# Layouts: where each global position sits when T is cut over n devices.

def layout_positions(T: int, num_devices: int, layout: str = "natural") -> np.ndarray:
  """`[T]` int32: the global position held at each index of the laid-out sequence."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
  if layout == "natural":
    return np.arange(T, dtype=np.int32)
  if T % (2 * num_devices):
    raise ValueError(f"the zigzag layout needs T={T} divisible by 2 * devices = {2 * num_devices}")
  half = T // (2 * num_devices)
  chunks = [c for i in range(num_devices) for c in (i, 2 * num_devices - 1 - i)]
  return np.concatenate([np.arange(c * half, (c + 1) * half) for c in chunks]).astype(np.int32)


def to_layout(x_BT: np.ndarray | jax.Array, num_devices: int, layout: str) -> np.ndarray | jax.Array:
  """Natural order -> `layout` along axis 1."""
  return x_BT[:, layout_positions(x_BT.shape[1], num_devices, layout)]


def from_layout(x_BT: np.ndarray | jax.Array, num_devices: int, layout: str
                ) -> np.ndarray | jax.Array:
  """`layout` -> natural order along axis 1 (the inverse of `to_layout`)."""
  return x_BT[:, np.argsort(layout_positions(x_BT.shape[1], num_devices, layout))]


def permute_batch(batch: dict, num_devices: int, layout: str) -> dict:
  """A host batch of `[B, T]` arrays in `layout`, plus its `positions` (for RoPE).

  The natural layout returns the batch unchanged. Every array is permuted the
  same way, so a position-wise loss (weighted NLL) is unchanged.
  """
  if layout == "natural":
    return batch
  B, T = batch["inputs"].shape
  positions_T = layout_positions(T, num_devices, layout)
  out = {name: np.asarray(x)[:, positions_T] for name, x in batch.items()}
  out["positions"] = np.broadcast_to(positions_T, (B, T)).copy()
  return out


# Plumbing.

def num_devices(mesh: jax.sharding.Mesh, axis_name: str) -> int:
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}")
  return mesh.shape[axis_name]


def _seq_spec(mesh: jax.sharding.Mesh, axis_name: str, heads: bool = False) -> P:
  """`[B, T, ...]`: B over the batch axes the mesh has (`data`, `fsdp`), T over `axis_name`, and
  with `heads` a `[B, T, H, ...]` array's H over `tensor` (tensor-parallel attention stays
  split by heads inside the ring)."""
  batch = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names and a != axis_name) or None
  tensor = "tensor" if heads and "tensor" in mesh.axis_names and axis_name != "tensor" else None
  return P(batch, axis_name, tensor) if tensor else P(batch, axis_name)


def _kv_specs(mesh: jax.sharding.Mesh, axis_name: str, q_heads: int, kv_heads: int):
  """(k / v's spec, `take(x)`: this device's k / v inside the body). Grouped key/value heads
  split over `tensor` with the query heads when its size divides them; else they travel whole
  and each device takes the one its query heads share (`kernel_mesh.whole_kv_heads`)."""
  heads = _seq_spec(mesh, axis_name, heads=True)
  tensor = heads[2] if len(heads) > 2 else None
  if tensor is None or not kernel_mesh.whole_kv_heads(q_heads, kv_heads, mesh.shape[tensor]):
    return heads, lambda x: x
  take = lambda x: None if x is None else kernel_mesh.kv_heads_of(x, 2, q_heads, kv_heads, tensor)
  return _seq_spec(mesh, axis_name), take


def _check_length(T: int, n: int) -> int:
  if T % n:
    raise ValueError(f"the sequence length T={T} must be divisible by the {n} devices of the "
                     "context axis (set data.seq_len to a multiple of mesh.context)")
  return T // n


def _sharded(body, mesh: jax.sharding.Mesh, arrays_and_specs: list, out_specs):
  """`jax.shard_map(body)` over the given arrays; a None array is passed through as None."""
  present = [(i, a, s) for i, (a, s) in enumerate(arrays_and_specs) if a is not None]

  def inner(*given):
    full = [None] * len(arrays_and_specs)
    for (i, _, _), x in zip(present, given):
      full[i] = x
    return body(*full)

  # Unchecked varying axes: a kernel's outputs (a custom call) carry none to check.
  return jax.shard_map(inner, mesh=mesh, in_specs=tuple(s for _, _, s in present),
                       out_specs=out_specs, check_vma=False)(*(a for _, a, _ in present))


def _from_behind(x, hops: int, axis_name: str, n: int):
  """Device i receives device i - hops's `x` (a pytree); zeros where that is before device 0."""
  if hops == 0:
    return x
  if hops >= n:
    return jax.tree.map(jnp.zeros_like, x)
  return jax.lax.ppermute(x, axis_name, [(i, i + hops) for i in range(n - hops)])


def _shifted(x_BC: jax.Array, distance: int, axis_name: str, n: int) -> jax.Array:
  """The local view of the global x[:, i - distance] (zeros before the start).

  With distance = h*C + r, local position p < r reads device h + 1 back, p >= r
  device h back: two ppermutes of r and C - r tokens.
  """
  C = x_BC.shape[1]
  hops, rest = divmod(distance, C)
  if rest == 0:
    return _from_behind(x_BC, hops, axis_name, n)
  return jnp.concatenate([_from_behind(x_BC[:, C - rest:], hops + 1, axis_name, n),
                          _from_behind(x_BC[:, :C - rest], hops, axis_name, n)], axis=1)


def _with_halo(x_BC: jax.Array, halo: int, axis_name: str, n: int) -> jax.Array:
  """The previous `halo` tokens followed by the local chunk: `[B, halo + C, ...]`."""
  if halo == 0:
    return x_BC
  C = x_BC.shape[1]
  hops = -(-halo // C)
  first = halo - (hops - 1) * C  # only the tail of the farthest device
  pieces = [_from_behind(x_BC[:, C - first:], hops, axis_name, n)]
  pieces += [_from_behind(x_BC, h, axis_name, n) for h in range(hops - 1, 0, -1)]
  return jnp.concatenate(pieces + [x_BC], axis=1)


def halo(pattern: Pattern, chunk: int, T: int | None = None) -> int:
  """Keys from behind a chunk of `chunk` queries that its queries can see: the ring's halo, and a
  sequence-chunked block's (`models/chunking.py`). Chunks start at multiples of `chunk`, itself
  a multiple of the pattern's block size; with T, never more than the T - chunk keys before the
  last chunk.

  From the pattern: the distance from a chunk's first query, far from the sequence start, to the
  lowest key `pattern.key_range` lets the chunk see (its reach, for windows and π).
  """
  if pattern.reach is None:
    raise ValueError(f"{pattern} has unbounded reach (its queries see back to the sequence "
                     "start): it has no halo, so it cannot be cut into chunks (set "
                     "model.seq_chunk=0 for it)")
  first = chunk * (2 + pattern.reach // chunk)  # beyond the reach: nothing is clipped at 0
  lowest, _ = pattern.key_range(first, first + chunk - 1)
  return first - lowest if T is None else min(first - lowest, T - chunk)


# Attention.

def check_pattern(pattern: Pattern, T: int, n: int, layout: str) -> None:
  """Raises ValueError when `pattern` has no ring over n devices at length T in `layout`."""
  C = _check_length(T, n)
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
  if pattern.has_skips and pattern.reach is None:
    raise ValueError(f"{pattern} skips back to the sequence start: it has no ring version (its "
                     "halo would be the whole sequence); bound it (num_skips / Pattern.skip_to)")
  if pattern.reach is None and not (pattern.causal and pattern.block_size is None):
    raise ValueError(f"{pattern} sees the whole sequence both ways: it has no ring version")
  if pattern.reach is not None and layout != "natural":
    raise ValueError(f"a pattern of bounded reach ({pattern}) is sharded in the natural layout, "
                     f"not {layout!r}")
  if pattern.block_size is not None and C % pattern.block_size:
    raise ValueError(f"block_size={pattern.block_size} must divide the {C} tokens each of the {n} "
                     f"devices holds (T={T}): blocks may not straddle devices")


def attend(q_BTHK, k_BTHK, v_BTHK, pattern: Pattern, *, mesh: jax.sharding.Mesh,
           axis_name: str = "context", layout: str = "natural", scale: float | None = None,
           local_prior: jax.Array | None = None, skip_prior: jax.Array | None = None,
           segment_ids: jax.Array | None = None, impl: str = "xla",
           interpret: bool = False) -> jax.Array:
  """Self-attention of a sequence sharded along T (see the module docstring): o `[B, T, H, K]`.

  k / v `[B, T, H_kv, K]` (H_kv dividing H: grouped-query attention; only their heads travel
  around the ring). `local_prior` / `skip_prior` `[B, T, H]` and `segment_ids` `[B, T]`
  (document ids) are sharded like the sequence.
  """
  n = num_devices(mesh, axis_name)
  check_pattern(pattern, q_BTHK.shape[1], n, layout)
  if pattern.reach is not None:
    return _local_attend(q_BTHK, k_BTHK, v_BTHK, pattern, mesh=mesh, axis_name=axis_name,
                         scale=scale, local_prior=local_prior, skip_prior=skip_prior,
                         segment_ids=segment_ids, impl=impl, interpret=interpret)
  if local_prior is not None or skip_prior is not None:
    raise ValueError("ring attention over the whole causal context takes no priors")
  return _ring_attend(q_BTHK, k_BTHK, v_BTHK, mesh=mesh, axis_name=axis_name, layout=layout,
                      scale=scale, segment_ids=segment_ids, impl=impl, interpret=interpret)


def _local_attend(q_BTHK, k_BTHK, v_BTHK, pattern: Pattern, *, mesh, axis_name, scale,
                  local_prior, skip_prior, segment_ids, impl, interpret) -> jax.Array:
  """A bounded pattern: each device's queries over its chunk and a halo of keys from behind, at
  idx * C + arange(C) and idx * C - halo + arange(halo + C) (on device 0 the halo's positions
  are negative, so never visible)."""
  n = num_devices(mesh, axis_name)
  T = q_BTHK.shape[1]
  C = T // n
  reach = halo(pattern, C, T)
  heads, seq = _seq_spec(mesh, axis_name, heads=True), _seq_spec(mesh, axis_name)
  kv, take = _kv_specs(mesh, axis_name, q_BTHK.shape[2], k_BTHK.shape[2])

  def body(q_BCHK, k_BCHK, v_BCHK, lp_BCH, sp_BCH, seg_BC):
    k_BCHK, v_BCHK = take(k_BCHK), take(v_BCHK)
    extend = lambda x: _with_halo(x, reach, axis_name, n)
    o_BCHK, _ = core.attend(
        q_BCHK, extend(k_BCHK), extend(v_BCHK), pattern,
        q_start=jax.lax.axis_index(axis_name) * C, k_offset=-reach, q_align=C, scale=scale,
        local_prior=lp_BCH, skip_prior=sp_BCH, q_segments=seg_BC,
        k_segments=None if seg_BC is None else extend(seg_BC), impl=impl, interpret=interpret,
        with_lse=False)
    return o_BCHK

  return _sharded(body, mesh, [(q_BTHK, heads), (k_BTHK, kv), (v_BTHK, kv),
                               (local_prior, heads), (skip_prior, heads), (segment_ids, seq)],
                  heads)


def _chunk_pieces(C: int, layout: str) -> list[tuple[int, int]]:
  """(start, length) of the contiguous runs of positions in a device's chunk."""
  return [(0, C)] if layout == "natural" else [(0, C // 2), (C // 2, C // 2)]


def _add_rows(x_BC, rows: slice, update_BC: jax.Array) -> jax.Array:
  """x_BC with `update_BC` added at x_BC[:, rows] (a static slice), as a dynamic-update-slice:
  `.at[:, rows].add` is a scatter whose empty index constant, inside a custom VJP under
  shard_map, crashes jaxlib 0.11.2's partitioner (Shardy)."""
  current = jax.lax.slice_in_dim(x_BC, rows.start, rows.stop, axis=1)
  return jax.lax.dynamic_update_slice_in_dim(x_BC, current + update_BC, rows.start, axis=1)


# A ring step's (query piece, key piece) is one of three cases: keys wholly in the future (no
# work), the same positions (causal), or wholly in the past (all visible). Each is a core call
# with a static key offset, so a kernel gets a static mask: in the past case every key is
# visible, and it is placed just before the queries (`-length`), which changes no mask.
_NONE, _DIAGONAL, _PAST = 0, 1, 2


def _case(q_start, k_start):
  return jnp.where(k_start > q_start, _NONE, jnp.where(k_start == q_start, _DIAGONAL, _PAST))


def _ring_attend(q_BTHK, k_BTHK, v_BTHK, *, mesh, axis_name, layout, scale, segment_ids, impl,
                 interpret) -> jax.Array:
  """Dense causal attention, T sharded: ring attention with a ring backward.

  For n steps each device attends its queries to the keys/values it holds,
  then passes them on (ppermute i -> i + 1); `core.merge` combines the steps.
  With `layout='natural'` device i works i + 1 steps; with `layout='zigzag'`
  (arrays already in that order) every device does the same work. Cost
  O(T * C) per device, no `[C, C]` array (the core's blocks).

  The backward pass is hand-written (a custom VJP per device): it keeps only
  the device's q, k, v, o and lse (O(C)), and rotates the keys/values around
  the ring again with their gradients travelling alongside, each step the
  backend's flash backward of a piece at the final o and lse
  (`core.attend_backward`); after n rotations every device holds the gradients
  of its own keys/values.
  """
  n = num_devices(mesh, axis_name)
  B, T, H, K = q_BTHK.shape
  C = T // n
  positions_T = layout_positions(T, n, layout)  # numpy: the custom VJP rules may close over it
  pieces = _chunk_pieces(C, layout)
  dense = Pattern.dense()
  ring = [(i, (i + 1) % n) for i in range(n)]
  common = dict(scale=scale, impl=impl, interpret=interpret)

  def positions(step):
    """This device's query positions and, at `step`, the positions of the keys it holds."""
    idx = jax.lax.axis_index(axis_name)
    at = lambda device: jax.lax.dynamic_slice_in_dim(positions_T, device * C, C)
    return at(idx), at((idx - step) % n)

  def pairs(step):
    """(query piece, key piece, their starting positions) of one step; positions ascend in a piece."""
    q_pos, k_pos = positions(step)
    return [((qs, ql), (ks, kl), q_pos[qs], k_pos[ks]) for qs, ql in pieces for ks, kl in pieces]

  def ids(seg_BC, start, length):
    return None if seg_BC is None else seg_BC[:, start:start + length]

  def forward(q_BCHK, k_BCHK, v_BCHK, qseg_BC, kseg_BC):
    def piece(q, k, v, q_start, qseg, kseg, offset):
      return core.attend(q, k, v, dense, q_start=q_start, k_offset=offset, q_align=q.shape[1],
                         q_segments=qseg, k_segments=kseg, **common)

    def step(s, kv, merged):
      """Attend to the keys/values held at step s; merge into the running (o, lse) per piece."""
      merged = list(merged)
      k_BCHK, v_BCHK, kseg_BC = kv
      for (qs, ql), (ks, kl), q_start, k_start in pairs(s):
        args = (q_BCHK[:, qs:qs + ql], k_BCHK[:, ks:ks + kl], v_BCHK[:, ks:ks + kl], q_start,
                ids(qseg_BC, qs, ql), ids(kseg_BC, ks, kl))
        none = lambda q, *_: (jnp.zeros_like(q),
                              jnp.zeros_like(q[..., 0], jnp.float32) + core.NO_KEY_LSE)
        part = jax.lax.switch(_case(q_start, k_start), [
            none, lambda *a: piece(*a, 0), lambda *a: piece(*a, -ql)], *args)
        i = pieces.index((qs, ql))
        merged[i] = core.merge([merged[i], part])
      return tuple(merged)

    def step_and_pass(s, carry):
      kv, merged = carry
      return jax.lax.ppermute(kv, axis_name, ring), step(s, kv, merged)

    # Nothing seen yet: o = 0, lse = NO_KEY_LSE (weight 0 in the first merge).
    # The running output stays float32 across the steps (cast once at the end): rounding it to
    # bfloat16 after every merge would grow the error with the number of devices.
    empty = tuple((jnp.zeros_like(q_BCHK[:, qs:qs + ql], dtype=jnp.float32),
                   jnp.full_like(q_BCHK[:, qs:qs + ql, :, 0], core.NO_KEY_LSE, jnp.float32))
                  for qs, ql in pieces)
    # A loop over the steps (fixed buffers); the last step, outside it, sends nothing.
    kv, merged = jax.lax.fori_loop(0, n - 1, step_and_pass,
                                   ((k_BCHK, v_BCHK, kseg_BC), empty))
    merged = step(n - 1, kv, merged)
    return (jnp.concatenate([o for o, _ in merged], axis=1).astype(q_BCHK.dtype),
            jnp.concatenate([lse for _, lse in merged], axis=1))

  @jax.custom_vjp
  def body(q_BCHK, k_BCHK, v_BCHK, seg_BC):
    return forward(q_BCHK, k_BCHK, v_BCHK, seg_BC, seg_BC)[0]

  def body_fwd(q_BCHK, k_BCHK, v_BCHK, seg_BC):
    o_BCHK, lse_BCH = forward(q_BCHK, k_BCHK, v_BCHK, seg_BC, seg_BC)
    return o_BCHK, (q_BCHK, k_BCHK, v_BCHK, seg_BC, o_BCHK, lse_BCH)

  def body_bwd(residuals, do_BCHK):
    q_BCHK, k_BCHK, v_BCHK, qseg_BC, o_BCHK, lse_BCH = residuals

    def grads(q, k, v, q_start, qseg, kseg, o, lse, do, offset):
      dq, dk, dv, _, _ = core.attend_backward(
          q, k, v, dense, o, lse, do, q_start=q_start, k_offset=offset, q_align=q.shape[1],
          q_segments=qseg, k_segments=kseg, **common)
      return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)

    def step(s, carry):
      """The gradients from the keys/values held at step s: dq stays, dk/dv travel with them."""
      dq_BCHK, (k_BCHK, v_BCHK, kseg_BC, dk_BCHK, dv_BCHK) = carry
      for (qs, ql), (ks, kl), q_start, k_start in pairs(s):
        rows, cols = slice(qs, qs + ql), slice(ks, ks + kl)
        args = (q_BCHK[:, rows], k_BCHK[:, cols], v_BCHK[:, cols], q_start,
                ids(qseg_BC, qs, ql), ids(kseg_BC, ks, kl), o_BCHK[:, rows], lse_BCH[:, rows],
                do_BCHK[:, rows])
        none = lambda q, k, v, *_: tuple(jnp.zeros_like(x, jnp.float32) for x in (q, k, v))
        dq, dk, dv = jax.lax.switch(_case(q_start, k_start), [
            none, lambda *a: grads(*a, 0), lambda *a: grads(*a, -ql)], *args)
        dq_BCHK = _add_rows(dq_BCHK, rows, dq)
        dk_BCHK = _add_rows(dk_BCHK, cols, dk)
        dv_BCHK = _add_rows(dv_BCHK, cols, dv)
      return dq_BCHK, (k_BCHK, v_BCHK, kseg_BC, dk_BCHK, dv_BCHK)

    def step_and_pass(s, carry):
      dq_BCHK, travelling = step(s, carry)
      return dq_BCHK, jax.lax.ppermute(travelling, axis_name, ring)

    f32 = lambda x: jnp.zeros_like(x, jnp.float32)
    carry = (f32(q_BCHK), (k_BCHK, v_BCHK, qseg_BC, f32(k_BCHK), f32(v_BCHK)))
    carry = jax.lax.fori_loop(0, n - 1, step_and_pass, carry)
    dq_BCHK, (_, _, _, dk_BCHK, dv_BCHK) = step(n - 1, carry)
    # After the last step only the gradients travel: one hop brings them home to their owner.
    dk_BCHK, dv_BCHK = jax.lax.ppermute((dk_BCHK, dv_BCHK), axis_name, ring)
    return (dq_BCHK.astype(q_BCHK.dtype), dk_BCHK.astype(k_BCHK.dtype),
            dv_BCHK.astype(v_BCHK.dtype), None)

  body.defvjp(body_fwd, body_bwd)
  heads, seq = _seq_spec(mesh, axis_name, heads=True), _seq_spec(mesh, axis_name)
  kv, take = _kv_specs(mesh, axis_name, H, k_BTHK.shape[2])
  return _sharded(lambda q, k, v, seg: body(q, take(k), take(v), seg), mesh,
                  [(q_BTHK, heads), (k_BTHK, kv), (v_BTHK, kv), (segment_ids, seq)], heads)


# The sequence-wide ops of BCMT's memory.

def shift_right(x_BT: jax.Array, distance: int, *, mesh: jax.sharding.Mesh,
                axis_name: str = "context") -> jax.Array:
  """x[:, i - distance] at position i (zeros before the start), T sharded."""
  n = num_devices(mesh, axis_name)
  _check_length(x_BT.shape[1], n)
  spec = _seq_spec(mesh, axis_name)
  body = lambda x: _shifted(x, distance, axis_name, n)
  return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x_BT)


def shifts_right(x_BT: jax.Array, count: int, *, mesh: jax.sharding.Mesh,
                 axis_name: str = "context") -> tuple[jax.Array, ...]:
  """(x[:, i - 1], ..., x[:, i - count]) at position i (zeros before the start), T sharded: one
  halo of the `count` tokens before each device's chunk (a causal convolution's taps)."""
  n = num_devices(mesh, axis_name)
  C = _check_length(x_BT.shape[1], n)
  spec = _seq_spec(mesh, axis_name)

  def body(x_BC):
    window = _with_halo(x_BC, count, axis_name, n)  # [B, count + C, ...]
    return tuple(window[:, count - j:count - j + C] for j in range(1, count + 1))

  return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec,) * count)(x_BT)


def exponential_memory(s_BND: jax.Array, alpha: float | jax.Array,
                       keep_BN: jax.Array | None = None, *, mesh: jax.sharding.Mesh,
                       axis_name: str = "context") -> jax.Array:
  """`memory.exponential_memory` with the N blocks sharded.

  Each device runs the recurrence on its blocks from a zero state (`memory.memory_sums`); the
  state entering it, the earlier devices' totals decayed by the blocks in between (0 past a
  restart), is an exclusive prefix computed by a log-step scan of the per-row affine maps
  x -> A x + (num, den) over the devices (ppermute by 1, 2, 4, ...).
  """
  memory._check_alpha(alpha)  # pylint: disable=protected-access
  n = num_devices(mesh, axis_name)
  _check_length(s_BND.shape[1], n)
  spec = _seq_spec(mesh, axis_name)

  def body(s_BND, alpha, keep_BN):
    idx = jax.lax.axis_index(axis_name)
    num_BND, den_BN = memory.memory_sums(s_BND, alpha, keep_BN)
    decay_BN = jnp.cumprod(memory._decay(s_BND, alpha, keep_BN), axis=1)  # pylint: disable=protected-access
    # This device as an affine map of the entering state: x -> A x + (num, den) totals.
    total = (decay_BN[:, -1], num_BND[:, -1], den_BN[:, -1])
    hops = 1
    while hops < n:  # inclusive prefix: compose with the range `hops` devices behind
      prev_A, prev_num_BD, prev_den_B = _from_behind(total, hops, axis_name, n)
      has = idx >= hops
      A_B, num_BD, den_B = total
      total = (jnp.where(has, prev_A * A_B, A_B),
               jnp.where(has, A_B[:, None] * prev_num_BD + num_BD, num_BD),
               jnp.where(has, A_B * prev_den_B + den_B, den_B))
      hops *= 2
    _, in_num_BD, in_den_B = _from_behind(total, 1, axis_name, n)  # exclusive: zeros on device 0
    num_BND = num_BND + decay_BN[..., None] * in_num_BD[:, None, :]
    den_BN = den_BN + decay_BN * in_den_B[:, None]
    return (num_BND / den_BN[..., None]).astype(s_BND.dtype)

  keep = jnp.ones(s_BND.shape[:2], jnp.float32) if keep_BN is None else keep_BN.astype(jnp.float32)
  return jax.shard_map(body, mesh=mesh, in_specs=(spec, P(), spec), out_specs=spec)(
      s_BND, jnp.asarray(alpha, jnp.float32), keep)
