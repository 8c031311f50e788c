"""The gated delta rule with the sequence sharded over a mesh axis (context parallelism;
docs/architecture.md, "The gated delta rule").

Over a device's C tokens the recurrence is an affine map of the state that enters them,

    S_out = M S_in + N,   M = A_C ... A_1,   A_t = exp(g_t) (I - beta_t k_t k_t^T)  (0 at a start)

and each output is o_t = o_t(from 0) + S_in^T P_t^T (scale q_t), P_t = A_t ... A_1. All of it
comes from one run of the chunked form (`chunked.chunked`) on an augmented state [M | S]
`[K, K + V]` entered as [I | 0], with values [0 | v]: the linear columns carry M (and P_t^T q_t
as the first K output columns) through the same chunk arithmetic, never a `[K, K]` matrix per
token. A document start inside the device zeroes both parts: M is 0 from there on. Then every
device gathers the devices' (M, N) pairs (n small matrices), composes those before it into its
entering state (the initial state, or 0, on device 0) and corrects its outputs:
O(C (K + V) K) work per device on top of the single-device cost, one all-gather of
n `[B, H, K, K + V]` maps.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from efficient_lm.ops import ring as ops_ring
from efficient_lm.ops.recurrent import chunked as chunked_lib

# The attention ring's shard_map plumbing (its specs, length check, neighbour exchange), shared.
# pylint: disable=protected-access

F32 = jnp.float32


def devices(mesh: jax.sharding.Mesh, axis_name: str) -> int:
  """Devices along `axis_name` (a ValueError naming the mesh's axes if it has none such)."""
  return ops_ring.num_devices(mesh, axis_name)


def gated_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT, initial_state_BHKV,
                     *, scale: float, chunk_size: int, scan: chunked_lib.Scan,
                     mesh: jax.sharding.Mesh, axis_name: str, delta: bool = True
                     ) -> tuple[jax.Array, jax.Array]:
  """(o `[B, T, H, V]` float32, final state `[B, H, K, V]` float32) with T sharded over
  `axis_name`; equal to the single-device op (`delta=False`: the gated linear recurrence, the
  same maps with A_t = exp(g_t) I)."""
  n = devices(mesh, axis_name)
  B, T, H, K = q_BTHK.shape
  V = v_BTHV.shape[-1]
  ops_ring._check_length(T, n)
  heads = ops_ring._seq_spec(mesh, axis_name, heads=True)
  seq = ops_ring._seq_spec(mesh, axis_name)
  state = P(heads[0], *heads[2:])  # [B, H, K, V]: B and H as the sequence's, not T
  stacked = P(axis_name, *state)   # one state per device, stacked along the context axis

  def body(q_BCHK, k_BCHK, v_BCHV, g_BCH, beta_BCH, seg_BC, initial_BHKV):
    idx = jax.lax.axis_index(axis_name)
    b, C, h = q_BCHK.shape[:3]
    starts_BC = None
    if seg_BC is not None:  # the first token starts a document if the id before it differs
      before_B1 = ops_ring._from_behind(seg_BC[:, -1:], 1, axis_name, n)
      first_B1 = (seg_BC[:, :1] != before_B1) & (idx > 0)
      starts_BC = jnp.concatenate([first_B1, chunked_lib.starts_of(seg_BC)[:, 1:]], axis=1)
    zeros_BCHK = jnp.zeros((b, C, h, K), F32)
    eye_BHKK = jnp.broadcast_to(jnp.eye(K, dtype=F32), (b, h, K, K))
    augmented_BHKX = jnp.concatenate([eye_BHKK, jnp.zeros((b, h, K, V), F32)], axis=-1)
    o_BCHX, map_BHKX = chunked_lib.chunked(
        q_BCHK.astype(F32) * scale, k_BCHK, jnp.concatenate([zeros_BCHK, v_BCHV.astype(F32)], -1),
        g_BCH, beta_BCH, starts_BC, augmented_BHKX, chunk_size, scan, delta)
    maps_DBHKX = jax.lax.all_gather(map_BHKX, axis_name)
    # The state entering each device: compose the maps of those before it (n is small).
    S_BHKV = jnp.zeros((b, h, K, V), F32) if initial_BHKV is None else initial_BHKV.astype(F32)
    entering = []
    for d in range(n):
      entering.append(S_BHKV)
      M_BHKK, N_BHKV = maps_DBHKX[d, ..., :K], maps_DBHKX[d, ..., K:]
      S_BHKV = jnp.einsum("bhij,bhjv->bhiv", M_BHKK, S_BHKV) + N_BHKV
    S_in_BHKV = jnp.stack(entering)[idx]
    o_BCHV = o_BCHX[..., K:] + jnp.einsum("bchk,bhkv->bchv", o_BCHX[..., :K], S_in_BHKV)
    return o_BCHV, S_BHKV[None]

  arrays = [(q_BTHK, heads), (k_BTHK, heads), (v_BTHV, heads), (g_BTH, heads), (beta_BTH, heads),
            (segment_ids_BT, seq), (initial_state_BHKV, state)]
  o_BTHV, finals_DBHKV = ops_ring._sharded(body, mesh, arrays, (heads, stacked))
  return o_BTHV, finals_DBHKV[-1]
