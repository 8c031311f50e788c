"""Context-parallel (ring) versions of the ops (SPEC section 8).

Each op has the signature of its single-device twin plus keyword-only `mesh`
and `axis_name`: it takes and returns *global* arrays whose T axis is sharded
over `mesh.shape[axis_name]` devices (and B over `data` when the mesh has that
axis), and equals the single-device op. Inside `jax.shard_map` every device
holds C = T / devices tokens and receives what it needs from the devices
behind it with `jax.lax.ppermute`; no device ever gathers the whole sequence.

- `sliding_window_attention`, `pi_attention`: a halo of the previous window - 1
  keys/values (from several devices back when the window is wider than C); a
  skip at distance d = h*C + r comes from the devices h and h + 1 back. The
  local chunk plus halo runs through the single-device blockwise core.
- `block_local_attention`: blocks aligned with the chunks (C a multiple of
  block_size); lookback b > 0 is a halo of b blocks.
- `exponential_memory`: each device's (numerator, denominator) totals,
  combined into an exclusive prefix by a log-step (Hillis-Steele) ppermute
  scan over devices: ceil(log2 devices) + 1 exchanges.
- `causal_attention`: ring attention. Keys/values rotate around the ring with
  an online log-sum-exp softmax; pieces of work that are entirely in the
  future are skipped (`lax.cond`). `layout='zigzag'` (each device holds
  chunks i and 2n-1-i of 2n) balances that work: use `to_layout` /
  `permute_batch` once on the batch and pass the matching positions to RoPE.
- `shift_right`: x[:, i - distance], the sharded twin of `attention.shift_right`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from efficient_lm.ops import attention
from efficient_lm.ops import blockwise
from efficient_lm.ops import memory

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


def _seq_spec(mesh: jax.sharding.Mesh, axis_name: str) -> P:
  """`[B, T, ...]`: B over `data` (when the mesh has it), T over `axis_name`."""
  batch = "data" if "data" in mesh.axis_names and axis_name != "data" else None
  return P(batch, axis_name)


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


def _pad_front(x_BC: jax.Array | None, size: int, value: float = 0.0) -> jax.Array | None:
  if x_BC is None or size == 0:
    return x_BC
  pad = [(0, 0), (size, 0)] + [(0, 0)] * (x_BC.ndim - 2)
  return jnp.pad(x_BC, pad, constant_values=value)


def _local_band(q_BCHK, k_BCHK, v_BCHK, *, halo: int, block_size: int, lookback: int,
                window: int | None, axis_name: str, n: int, scale, local_bias_BCH=None,
                extra_logits_BCHS=None, extra_v_BCSHK=None) -> jax.Array:
  """The blockwise core on this device's chunk, its keys extended by a `halo` from behind.

  Queries are padded in front by `halo` (their outputs dropped); keys before
  the sequence start (device 0's halo) are masked with `first_key`.
  """
  C = q_BCHK.shape[1]
  first_key = jnp.maximum(halo - jax.lax.axis_index(axis_name) * C, 0)
  o_BXHK = blockwise.blockwise_attention(
      _pad_front(q_BCHK, halo), _with_halo(k_BCHK, halo, axis_name, n),
      _with_halo(v_BCHK, halo, axis_name, n), block_size=block_size, lookback=lookback,
      window=window, scale=scale, local_bias_BTH=_pad_front(local_bias_BCH, halo),
      extra_logits_BTHS=_pad_front(extra_logits_BCHS, halo, blockwise.MASKED),
      extra_v_BTSHK=_pad_front(extra_v_BCSHK, halo), first_key=first_key)
  return o_BXHK[:, halo:]


def _window_band(C: int, T: int, window: int) -> dict:
  """Halo and block settings for i - window < j <= i on a chunk of C tokens."""
  halo = min(window - 1, T - C)  # never more than all the tokens before the last device
  return dict(halo=halo, **attention._window_blocks(halo + C, window))  # pylint: disable=protected-access


# The ops.

def shift_right(x_BT: jax.Array, distance: int, *, mesh: jax.sharding.Mesh,
                axis_name: str = "context") -> jax.Array:
  """x[:, i - distance] at position i (zeros before the start), T sharded."""
  n = _num_devices(mesh, axis_name)
  _check_length(x_BT.shape[1], n)
  spec = _seq_spec(mesh, axis_name)
  body = lambda x: _shifted(x, distance, axis_name, n)
  return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x_BT)


def sliding_window_attention(q_BTHK, k_BTHK, v_BTHK, *, window: int, scale: float | None = None,
                             mesh: jax.sharding.Mesh, axis_name: str = "context") -> jax.Array:
  """`attention.sliding_window_attention` with T sharded: a halo of window - 1 keys/values."""
  attention._check_positive("window", window)  # pylint: disable=protected-access
  n = _num_devices(mesh, axis_name)
  T = q_BTHK.shape[1]
  C = _check_length(T, n)
  band = _window_band(C, T, window)
  spec = _seq_spec(mesh, axis_name)
  body = functools.partial(_local_band, axis_name=axis_name, n=n, scale=scale, **band)
  return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(
      q_BTHK, k_BTHK, v_BTHK)


def pi_attention(q_BTHK, k_BTHK, v_BTHK, gate_BTH, *, window: int, period: int, num_skips: int,
                 scale: float | None = None, mesh: jax.sharding.Mesh,
                 axis_name: str = "context") -> jax.Array:
  """`attention.pi_attention` with T sharded.

  The window's halo comes from the devices behind; the skip keys/values at
  distance d = m * period from the devices floor(d / C) and floor(d / C) + 1
  behind (any period: below C, several Cs, past the start).
  """
  attention._check_positive("window", window)  # pylint: disable=protected-access
  attention._check_positive("period", period)  # pylint: disable=protected-access
  if not isinstance(num_skips, int) or num_skips < 0:
    raise ValueError(f"num_skips={num_skips!r} must be a non-negative integer")
  n = _num_devices(mesh, axis_name)
  B, T, H, K = q_BTHK.shape
  C = _check_length(T, n)
  scale = K ** -0.5 if scale is None else scale
  offsets = attention.skip_offsets(T, window=window, period=period, num_skips=num_skips)
  if not offsets:  # no skip ever lands: the gate shifts every logit of a row equally
    return sliding_window_attention(q_BTHK, k_BTHK, v_BTHK, window=window, scale=scale, mesh=mesh,
                                    axis_name=axis_name)
  band = _window_band(C, T, window)

  def body(q_BCHK, k_BCHK, v_BCHK, gate_BCH):
    gate_BCH = jnp.clip(gate_BCH.astype(jnp.float32), attention.GATE_EPS, 1.0 - attention.GATE_EPS)
    skip_k_BCSHK = jnp.stack([_shifted(k_BCHK, d, axis_name, n) for d in offsets], axis=2)
    skip_v_BCSHK = jnp.stack([_shifted(v_BCHK, d, axis_name, n) for d in offsets], axis=2)
    position_C = jax.lax.axis_index(axis_name) * C + jnp.arange(C)
    present_CS = position_C[:, None] >= jnp.asarray(offsets)[None, :]
    skip_logits_BCHS = attention.gated_skip_logits(q_BCHK, skip_k_BCSHK, gate_BCH, present_CS, scale)
    return _local_band(q_BCHK, k_BCHK, v_BCHK, axis_name=axis_name, n=n, scale=scale,
                       local_bias_BCH=jnp.log(gate_BCH), extra_logits_BCHS=skip_logits_BCHS,
                       extra_v_BCSHK=skip_v_BCSHK, **band)

  spec = _seq_spec(mesh, axis_name)
  return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)(
      q_BTHK, k_BTHK, v_BTHK, gate_BTH)


def block_local_attention(q_BTHK, k_BTHK, v_BTHK, *, block_size: int, lookback: int = 0,
                          scale: float | None = None, mesh: jax.sharding.Mesh,
                          axis_name: str = "context") -> jax.Array:
  """`attention.block_local_attention` with T sharded; C must be a multiple of block_size.

  Blocks never straddle devices; `lookback` blocks come in as a halo.
  """
  attention._check_positive("block_size", block_size)  # pylint: disable=protected-access
  if not isinstance(lookback, int) or lookback < 0:
    raise ValueError(f"lookback={lookback!r} must be a non-negative integer")
  n = _num_devices(mesh, axis_name)
  T = q_BTHK.shape[1]
  C = _check_length(T, n)
  if C % block_size:
    raise ValueError(f"block_size={block_size} must divide the {C} tokens each of the {n} devices "
                     f"holds (T={T}): blocks may not straddle devices")
  halo = min(lookback * block_size, T - C)
  halo -= halo % block_size
  spec = _seq_spec(mesh, axis_name)
  body = functools.partial(_local_band, halo=halo, block_size=block_size,
                           lookback=halo // block_size, window=None, axis_name=axis_name, n=n,
                           scale=scale)
  return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(
      q_BTHK, k_BTHK, v_BTHK)


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


def _attend_piece(carry, q_BQHK, k_BKHK, v_BKHK, q_pos_Q, k_pos_K, scale):
  """One online-softmax update of (o, running max, normalizer) with a masked [Q, K] score block."""
  o_BQHK, max_BHQ, norm_BHQ = carry
  logits_BHQK = jnp.einsum("bqhk,bshk->bhqs", q_BQHK, k_BKHK,
                           preferred_element_type=jnp.float32) * scale
  visible_QK = q_pos_Q[:, None] >= k_pos_K[None, :]
  logits_BHQK = jnp.where(visible_QK, logits_BHQK, blockwise.MASKED)
  new_max_BHQ = jnp.maximum(max_BHQ, jnp.max(logits_BHQK, axis=-1))
  probs_BHQK = jnp.where(visible_QK, jnp.exp(logits_BHQK - new_max_BHQ[..., None]), 0.0)
  correction_BHQ = jnp.exp(max_BHQ - new_max_BHQ)
  norm_BHQ = norm_BHQ * correction_BHQ + jnp.sum(probs_BHQK, axis=-1)
  o_BQHK = (o_BQHK * jnp.transpose(correction_BHQ, (0, 2, 1))[..., None]
            + jnp.einsum("bhqs,bshk->bqhk", probs_BHQK, v_BKHK.astype(jnp.float32)))
  return o_BQHK, new_max_BHQ, norm_BHQ


def _chunk_pieces(C: int, layout: str) -> list[tuple[int, int]]:
  """(start, length) of the contiguous runs of positions in a device's chunk."""
  return [(0, C)] if layout == "natural" else [(0, C // 2), (C // 2, C // 2)]


def causal_attention(q_BTHK, k_BTHK, v_BTHK, *, scale: float | None = None,
                     mesh: jax.sharding.Mesh, axis_name: str = "context",
                     layout: str = "natural") -> jax.Array:
  """`attention.causal_attention` with T sharded: ring attention.

  For n steps each device attends its queries to the keys/values it holds,
  then passes them on (ppermute i -> i + 1); an online log-sum-exp softmax
  combines the steps. Work pieces wholly in the future are skipped, so with
  `layout='natural'` device i works i + 1 steps; with `layout='zigzag'`
  (arrays already in that order: see `to_layout`) every device does the same
  work. Cost O(T * C) per device; the [C, C] score block is the largest array.
  The backward pass is autodiff through the unrolled ring (each step
  rematerialized), which keeps every step's keys/values: O(T) per device.
  """
  n = _num_devices(mesh, axis_name)
  B, T, H, K = q_BTHK.shape
  C = _check_length(T, n)
  positions_T = jnp.asarray(layout_positions(T, n, layout))
  scale = K ** -0.5 if scale is None else scale
  pieces = _chunk_pieces(C, layout)

  def body(q_BCHK, k_BCHK, v_BCHK):
    idx = jax.lax.axis_index(axis_name)
    position_C = jax.lax.dynamic_slice_in_dim(positions_T, idx * C, C)
    carries = []  # (o, running max, normalizer) per query piece; zeros_like keeps them device-varying
    for start, length in pieces:
      zero_BHQ = jnp.zeros_like(jnp.swapaxes(q_BCHK[:, start:start + length, :, 0], 1, 2), jnp.float32)
      carries.append((jnp.zeros_like(q_BCHK[:, start:start + length], jnp.float32),
                      zero_BHQ + blockwise.MASKED, zero_BHQ))

    @jax.checkpoint
    def step(carries, kv, source):
      k_BCHK, v_BCHK = kv
      k_position_C = jax.lax.dynamic_slice_in_dim(positions_T, source * C, C)
      new = []
      for (qs, ql), carry in zip(pieces, carries):
        q_pos = position_C[qs:qs + ql]
        for ks, kl in pieces:
          k_pos = k_position_C[ks:ks + kl]
          update = functools.partial(_attend_piece, q_BQHK=q_BCHK[:, qs:qs + ql],
                                     k_BKHK=k_BCHK[:, ks:ks + kl], v_BKHK=v_BCHK[:, ks:ks + kl],
                                     q_pos_Q=q_pos, k_pos_K=k_pos, scale=scale)
          # Positions are ascending within a piece: skip it when its first key is after the last query.
          carry = jax.lax.cond(k_pos[0] <= q_pos[-1], update, lambda c: c, carry)
        new.append(carry)
      return new

    kv = (k_BCHK, v_BCHK)
    ring = [(i, (i + 1) % n) for i in range(n)]
    for s in range(n):  # n is small and static; unrolled so the last step sends nothing
      carries = step(carries, kv, (idx - s) % n)
      if s + 1 < n:
        kv = jax.lax.ppermute(kv, axis_name, ring)
    outs = [o_BQHK / jnp.transpose(norm_BHQ, (0, 2, 1))[..., None]
            for o_BQHK, _, norm_BHQ in carries]
    return jnp.concatenate(outs, axis=1).astype(v_BCHK.dtype)

  spec = _seq_spec(mesh, axis_name)
  return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(
      q_BTHK, k_BTHK, v_BTHK)
