"""Context-parallel (ring) versions of the ops (docs/architecture.md, "Context parallelism").

Each op has the signature of its single-device twin plus keyword-only `mesh` and `axis_name`: it
takes and returns *global* arrays whose T axis is sharded over `mesh.shape[axis_name]` devices (T
divisible by them), and equals the single-device op. No device gathers the whole sequence:
`sliding_window_attention`, `pi_attention` and `block_local_attention` (C = T / devices a multiple
of block_size) fetch a halo from the devices behind; `exponential_memory` combines the devices'
totals by a log-step prefix scan; `causal_attention` is ring attention (`layout='zigzag'`, with
`to_layout` / `permute_batch` once on the batch, balances its work); `shift_right` is the sharded
`attention.shift_right`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from efficient_lm.ops import attention
from efficient_lm.ops import core
from efficient_lm.ops import memory
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


# Plumbing shared by the ops.

def _num_devices(mesh: jax.sharding.Mesh, axis_name: str) -> int:
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


def _check_length(T: int, n: int) -> int:
  if T % n:
    raise ValueError(f"the sequence length T={T} must be divisible by the {n} devices of the "
                     "context axis (set data.seq_len to a multiple of mesh.context)")
  return T // n


def _from_behind(x: jax.Array, hops: int, axis_name: str, n: int) -> jax.Array:
  """Device i receives device i - hops's `x`; zeros where that is before device 0."""
  if hops == 0:
    return x
  if hops >= n:
    return jnp.zeros_like(x)
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


def _halo(pattern: Pattern, C: int, T: int) -> int:
  """Keys from behind a chunk of C tokens that its queries can see (never more than T - C).

  From the pattern: the distance from a chunk's first query to the lowest key
  `pattern.key_range` lets the chunk see (its reach, for windows and π).
  """
  unit = C * (pattern.block_size or 1)
  first = unit * (T // unit + 1)  # a chunk start far from the sequence start
  lowest, _ = pattern.key_range(first, first + C - 1)
  return min(first - lowest, T - C)


def _local_band(q_BCHK, k_BCHK, v_BCHK, local_prior_BCH=None, skip_prior_BCH=None, *,
                pattern: Pattern, halo: int, axis_name: str, n: int, scale) -> jax.Array:
  """The core on this device's chunk, its keys extended by a `halo` from behind.

  Queries sit at idx * C + arange(C), keys at idx * C - halo + arange(halo + C):
  on device 0 the halo's positions are negative, so never visible.
  """
  C = q_BCHK.shape[1]
  q_start = jax.lax.axis_index(axis_name) * C
  o_BCHK, _ = core.attend(q_BCHK, _with_halo(k_BCHK, halo, axis_name, n),
                          _with_halo(v_BCHK, halo, axis_name, n), pattern, q_start=q_start,
                          k_start=q_start - halo, scale=scale, local_prior=local_prior_BCH,
                          skip_prior=skip_prior_BCH)
  return o_BCHK


# The ops.

def shift_right(x_BT: jax.Array, distance: int, *, mesh: jax.sharding.Mesh,
                axis_name: str = "context") -> jax.Array:
  """x[:, i - distance] at position i (zeros before the start), T sharded."""
  n = _num_devices(mesh, axis_name)
  _check_length(x_BT.shape[1], n)
  spec = _seq_spec(mesh, axis_name)
  body = lambda x: _shifted(x, distance, axis_name, n)
  return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x_BT)


def _local_op(pattern: Pattern, mesh: jax.sharding.Mesh, axis_name: str, scale, arrays: tuple
              ) -> jax.Array:
  """`pattern` over global arrays (q, k, v, then optional [B, T, H] priors), T sharded."""
  n = _num_devices(mesh, axis_name)
  T = arrays[0].shape[1]
  C = _check_length(T, n)
  spec = _seq_spec(mesh, axis_name, heads=True)
  body = functools.partial(_local_band, pattern=pattern, halo=_halo(pattern, C, T),
                           axis_name=axis_name, n=n, scale=scale)
  return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(arrays), out_specs=spec)(*arrays)


def sliding_window_attention(q_BTHK, k_BTHK, v_BTHK, *, window: int, scale: float | None = None,
                             mesh: jax.sharding.Mesh, axis_name: str = "context") -> jax.Array:
  """`attention.sliding_window_attention` with T sharded: a halo of window - 1 keys/values."""
  attention._check_positive("window", window)  # pylint: disable=protected-access
  return _local_op(Pattern.sliding(window), mesh, axis_name, scale, (q_BTHK, k_BTHK, v_BTHK))


def pi_attention(q_BTHK, k_BTHK, v_BTHK, gate_BTH=None, *, window: int, period: int,
                 num_skips: int, scale: float | None = None, gate_logits_BTH=None,
                 mesh: jax.sharding.Mesh, axis_name: str = "context") -> jax.Array:
  """`attention.pi_attention` with T sharded.

  The halo is the pattern's reach, max(window - 1, farthest skip) keys/values
  from the devices behind (any period: below C, several Cs, past the start);
  the core then reads the window and the skips from chunk + halo.
  """
  attention.check_pi_settings(window, period, num_skips)
  local_BTH, skip_BTH = attention.gate_priors(gate_BTH, gate_logits_BTH)
  pattern = Pattern.pi(window, period, num_skips, seq_len=q_BTHK.shape[1])
  if not pattern.skips:  # no skip ever lands: the gate shifts every logit of a row equally
    return _local_op(pattern, mesh, axis_name, scale, (q_BTHK, k_BTHK, v_BTHK))
  return _local_op(pattern, mesh, axis_name, scale, (q_BTHK, k_BTHK, v_BTHK, local_BTH, skip_BTH))


def block_local_attention(q_BTHK, k_BTHK, v_BTHK, *, block_size: int, lookback: int = 0,
                          scale: float | None = None, mesh: jax.sharding.Mesh,
                          axis_name: str = "context") -> jax.Array:
  """`attention.block_local_attention` with T sharded; C must be a multiple of block_size.

  Blocks never straddle devices; `lookback` blocks come in as a halo.
  """
  attention._check_positive("block_size", block_size)  # pylint: disable=protected-access
  attention._check_lookback(lookback)  # pylint: disable=protected-access
  n = _num_devices(mesh, axis_name)
  T = q_BTHK.shape[1]
  C = _check_length(T, n)
  if C % block_size:
    raise ValueError(f"block_size={block_size} must divide the {C} tokens each of the {n} devices "
                     f"holds (T={T}): blocks may not straddle devices")
  return _local_op(Pattern.blocks(block_size, lookback), mesh, axis_name, scale,
                   (q_BTHK, k_BTHK, v_BTHK))


def exponential_memory(s_BND: jax.Array, alpha: float | jax.Array, *, mesh: jax.sharding.Mesh,
                       axis_name: str = "context") -> jax.Array:
  """`memory.exponential_memory` with the N blocks sharded.

  Each device runs the single-device memory on its blocks from a zero state
  (num_j / den_j, den_j = (1 - alpha^(j+1)) / (1 - alpha)); the state entering
  it, sum over earlier devices of alpha^(blocks in between) * their totals, is
  an exclusive prefix computed by a log-step scan of affine maps
  x -> alpha^Nc x + total over the devices (ppermute by 1, 2, 4, ...).
  """
  memory._check_alpha(alpha)  # pylint: disable=protected-access
  n = _num_devices(mesh, axis_name)
  Nc = _check_length(s_BND.shape[1], n)
  spec = _seq_spec(mesh, axis_name)

  def body(s_BND, alpha):
    idx = jax.lax.axis_index(axis_name)
    m_BND = memory.exponential_memory(s_BND, alpha).astype(jnp.float32)
    decay_N = alpha ** jnp.arange(1, Nc + 1, dtype=jnp.float32)
    den_N = (1.0 - decay_N) / (1.0 - alpha)
    num_BND = m_BND * den_N[:, None]
    # This device as an affine map of the state: x -> scale * x + (num, den) totals.
    total = (decay_N[-1], num_BND[:, -1], den_N[-1])
    hops = 1
    while hops < n:  # inclusive prefix: compose with the range `hops` devices behind
      prev_scale, prev_num_BD, prev_den = _from_behind(total, hops, axis_name, n)
      has = idx >= hops
      scale_i, num_BD, den = total
      total = (jnp.where(has, prev_scale * scale_i, scale_i),
               jnp.where(has, scale_i * prev_num_BD + num_BD, num_BD),
               jnp.where(has, scale_i * prev_den + den, den))
      hops *= 2
    _, in_num_BD, in_den = _from_behind(total, 1, axis_name, n)  # exclusive: zeros on device 0
    num_BND = num_BND + decay_N[:, None] * in_num_BD[:, None, :]
    den_N = den_N + decay_N * in_den
    return (num_BND / den_N[:, None]).astype(s_BND.dtype)

  return jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec)(
      s_BND, jnp.asarray(alpha, jnp.float32))


def _chunk_pieces(C: int, layout: str) -> list[tuple[int, int]]:
  """(start, length) of the contiguous runs of positions in a device's chunk."""
  return [(0, C)] if layout == "natural" else [(0, C // 2), (C // 2, C // 2)]


def _add_rows(x_BC, rows: slice, update_BC: jax.Array) -> jax.Array:
  """x_BC with `update_BC` added at x_BC[:, rows] (a static slice), as a dynamic-update-slice:
  `.at[:, rows].add` is a scatter whose empty index constant, inside a custom VJP under
  shard_map, crashes jaxlib 0.11.2's partitioner (Shardy)."""
  current = jax.lax.slice_in_dim(x_BC, rows.start, rows.stop, axis=1)
  return jax.lax.dynamic_update_slice_in_dim(x_BC, current + update_BC, rows.start, axis=1)


def causal_attention(q_BTHK, k_BTHK, v_BTHK, *, scale: float | None = None,
                     mesh: jax.sharding.Mesh, axis_name: str = "context",
                     layout: str = "natural") -> jax.Array:
  """`attention.causal_attention` with T sharded: ring attention, with a ring backward.

  For n steps each device attends its queries to the keys/values it holds,
  then passes them on (ppermute i -> i + 1). Each step is a core call per
  (query piece, key piece) at their positions, and `core.merge` combines them:
  pieces wholly in the future see no key block, so their work is skipped, and
  with `layout='natural'` device i works i + 1 steps; with `layout='zigzag'`
  (arrays already in that order: see `to_layout`) every device does the same
  work. Cost O(T * C) per device, no `[C, C]` array (the core's blocks).

  The backward pass is hand-written (a custom VJP per device): it keeps only
  the device's q, k, v, o and lse (O(C)), and rotates the keys/values around
  the ring again with their gradients travelling alongside, each step the
  core's flash backward of a piece at the final o and lse (`core.attend_backward`);
  after n rotations every device holds the gradients of its own keys/values.
  """
  n = _num_devices(mesh, axis_name)
  B, T, H, K = q_BTHK.shape
  C = _check_length(T, n)
  positions_T = layout_positions(T, n, layout)  # numpy: the custom VJP rules may close over it
  pieces = _chunk_pieces(C, layout)
  dense = Pattern.dense()
  ring = [(i, (i + 1) % n) for i in range(n)]

  def positions(step):
    """This device's query positions and, at `step`, the positions of the keys it holds."""
    idx = jax.lax.axis_index(axis_name)
    at = lambda device: jax.lax.dynamic_slice_in_dim(positions_T, device * C, C)
    return at(idx), at((idx - step) % n)

  def pairs(step):
    """(query piece, key piece, their starting positions) of one step; positions ascend in a piece."""
    q_pos, k_pos = positions(step)
    return [((qs, ql), (ks, kl), q_pos[qs], k_pos[ks]) for qs, ql in pieces for ks, kl in pieces]

  def forward(q_BCHK, k_BCHK, v_BCHK):
    def step(s, kv, merged):
      """Attend to the keys/values held at step s; merge into the running (o, lse) per piece."""
      merged = list(merged)
      for (qs, ql), (ks, kl), q_start, k_start in pairs(s):
        part = core.attend(q_BCHK[:, qs:qs + ql], kv[0][:, ks:ks + kl], kv[1][:, ks:ks + kl],
                           dense, q_start=q_start, k_start=k_start, scale=scale)
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
    kv, merged = jax.lax.fori_loop(0, n - 1, step_and_pass, ((k_BCHK, v_BCHK), empty))
    merged = step(n - 1, kv, merged)
    return (jnp.concatenate([o for o, _ in merged], axis=1).astype(q_BCHK.dtype),
            jnp.concatenate([lse for _, lse in merged], axis=1))

  @jax.custom_vjp
  def body(q_BCHK, k_BCHK, v_BCHK):
    return forward(q_BCHK, k_BCHK, v_BCHK)[0]

  def body_fwd(q_BCHK, k_BCHK, v_BCHK):
    o_BCHK, lse_BCH = forward(q_BCHK, k_BCHK, v_BCHK)
    return o_BCHK, (q_BCHK, k_BCHK, v_BCHK, o_BCHK, lse_BCH)

  def body_bwd(residuals, do_BCHK):
    q_BCHK, k_BCHK, v_BCHK, o_BCHK, lse_BCH = residuals

    def step(s, carry):
      """The gradients from the keys/values held at step s: dq stays, dk/dv travel with them."""
      dq_BCHK, (k_BCHK, v_BCHK, dk_BCHK, dv_BCHK) = carry
      for (qs, ql), (ks, kl), q_start, k_start in pairs(s):
        rows, cols = slice(qs, qs + ql), slice(ks, ks + kl)
        dq, dk, dv, _, _ = core.attend_backward(
            q_BCHK[:, rows], k_BCHK[:, cols], v_BCHK[:, cols], dense, o_BCHK[:, rows],
            lse_BCH[:, rows], do_BCHK[:, rows], q_start=q_start, k_start=k_start, scale=scale)
        dq_BCHK = _add_rows(dq_BCHK, rows, dq.astype(jnp.float32))
        dk_BCHK = _add_rows(dk_BCHK, cols, dk.astype(jnp.float32))
        dv_BCHK = _add_rows(dv_BCHK, cols, dv.astype(jnp.float32))
      return dq_BCHK, (k_BCHK, v_BCHK, dk_BCHK, dv_BCHK)

    def step_and_pass(s, carry):
      dq_BCHK, travelling = step(s, carry)
      return dq_BCHK, jax.lax.ppermute(travelling, axis_name, ring)

    f32 = lambda x: jnp.zeros_like(x, jnp.float32)
    carry = (f32(q_BCHK), (k_BCHK, v_BCHK, f32(k_BCHK), f32(v_BCHK)))
    carry = jax.lax.fori_loop(0, n - 1, step_and_pass, carry)
    dq_BCHK, (_, _, dk_BCHK, dv_BCHK) = step(n - 1, carry)
    # After the last step only the gradients travel: one hop brings them home to their owner.
    dk_BCHK, dv_BCHK = jax.lax.ppermute((dk_BCHK, dv_BCHK), axis_name, ring)
    return (dq_BCHK.astype(q_BCHK.dtype), dk_BCHK.astype(k_BCHK.dtype),
            dv_BCHK.astype(v_BCHK.dtype))

  body.defvjp(body_fwd, body_bwd)
  spec = _seq_spec(mesh, axis_name, heads=True)
  return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(
      q_BTHK, k_BTHK, v_BTHK)
