"""The gated delta rule in chunked form (docs/architecture.md, "The gated delta rule").

Per token, with the state S `[K, V]` (Yang, Kautz, Hatamizadeh, ICLR 2025):

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),
    o_t = S_t^T q_t                        (q already scaled)

Inside a chunk of C tokens entered with the state S_0, G_t = g_1 + ... + g_t and
D_ts = exp(G_t - G_s) (s <= t, same document), the pseudo-values u solve the
unit-lower-triangular system (the UT transform of the delta rule's WY form)

    (I + L) U = diag(beta) V - diag(beta gamma) K S_0,   L_ts = beta_t D_ts k_t.k_s  (s < t)

with gamma_t = exp(G_t) (0 from a document start in the chunk on: the entering state is cut).
So U = U' - W S_0 with U' = (I + L)^-1 diag(beta) V and W = (I + L)^-1 diag(beta gamma) K,
computed for every chunk at once (`prepare`: (I + L)^-1 by block doubling, all matmuls), and

    S_C = gamma_C S_0 + Kd^T (U' - W S_0),  Kd_s = k_s D_Cs        (the state scan, `state_scan`)
    O   = diag(gamma) Q S_0 + (Q K^T * D) (U' - W S_0)              (every chunk at once, `outputs`)

The chunks' quantities are `[C, C]` at most: O(T C) work and memory, never `[T, T]`. A document
start is a decay of exactly 0 before its token: D is 0 across documents and gamma after a start,
and Kd keeps only the chunk's last document. G_t - G_s is summed inside the `[C, C]` matrix
(g_{s+1} + ... + g_t: accurate when g is strongly negative) and exponentiated only where s < t,
where it is <= 0 (g <= 0), so nothing overflows. `prepare` and `outputs` are rematerialised in the
backward pass (`jax.checkpoint`): a step keeps the inputs, U', W, Kd and the chunks' entering
states, O(T (K + V) + T / C K V), not the `[C, C]` matrices.
"""

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32


class Chunks(NamedTuple):
  """What the scan of the states across chunks reads, chunks first: `[N, B, H, C, ...]`."""
  w_NBHCK: jax.Array      # W: the entering state's share of each pseudo-value
  u_NBHCV: jax.Array      # U': the pseudo-values from a zero entering state
  kd_NBHCK: jax.Array     # keys decayed to the chunk's end (0 before its last document start)
  decay_NBH: jax.Array    # gamma_C: what the entering state is multiplied by over the chunk


def starts_of(segment_ids_BT: jax.Array) -> jax.Array:
  """`[B, T]` bool: True where a document starts (the id differs from the one before); False at
  position 0, which continues the initial state."""
  changed_BT = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
  return jnp.pad(changed_BT, ((0, 0), (1, 0)))


def to_chunks(x_BT: jax.Array, C: int) -> jax.Array:
  """`[B, T, H, ...]` (T a multiple of C) -> `[N, B, H, C, ...]`: chunks first, as the scan
  reads them (no copy of its inputs in another layout)."""
  B, T, H = x_BT.shape[:3]
  x = x_BT.reshape(B, T // C, C, H, *x_BT.shape[3:])
  return jnp.moveaxis(x, (1, 3), (0, 2))


def from_chunks(x_NBHC: jax.Array) -> jax.Array:
  """`[N, B, H, C, ...]` -> `[B, N * C, H, ...]`."""
  N, B, H, C = x_NBHC.shape[:4]
  return jnp.moveaxis(x_NBHC, (0, 2), (1, 3)).reshape(B, N * C, H, *x_NBHC.shape[4:])


def _decays(g_NBHC: jax.Array, starts_NBC: jax.Array):
  """(D `[B, H, N, C, C]`: exp(G_t - G_s) for s <= t in the same document, else 0; gamma
  `[B, H, N, C]`: exp(G_t) while no document has started in the chunk, else 0)."""
  C = g_NBHC.shape[-1]
  doc_NBC = jnp.cumsum(starts_NBC.astype(jnp.int32), axis=-1)  # documents begun in the chunk
  same_NBCC = doc_NBC[..., :, None] == doc_NBC[..., None, :]
  strict_CC = jnp.tril(jnp.ones((C, C), bool), -1)
  strict_NB1CC = (same_NBCC & strict_CC)[:, :, None]
  # G_t - G_s as the sum g_{s+1} + ... + g_t inside the matrix (a cumulative sum down each
  # column, as Mamba-2's segment sum), not as a difference of two long cumulative sums, which
  # loses the small one's digits when g is strongly negative (and with them g's gradient).
  diff_NBHCC = jnp.cumsum(jnp.where(strict_CC, g_NBHC[..., :, None], 0.0), axis=-2)
  # Exponentials only where s < t, where the sum is <= 0 (never an overflow); the diagonal is
  # 1 exactly, out of the gradient.
  D_NBHCC = jnp.where(strict_NB1CC, jnp.exp(jnp.where(strict_NB1CC, diff_NBHCC, 0.0)),
                      jnp.eye(C))
  gamma_NBHC = jnp.where((doc_NBC == 0)[:, :, None], jnp.exp(jnp.cumsum(g_NBHC, axis=-1)), 0.0)
  return D_NBHCC, gamma_NBHC


@jax.custom_vjp
def unit_lower_inverse(L_XCC: jax.Array) -> jax.Array:
  """(I + L)^-1 for strictly lower-triangular L `[..., C, C]`, by doubling: the inverse of
  [[A, 0], [B, D]] is [[A^-1, 0], [-D^-1 B A^-1, D^-1]], so the inverted diagonal blocks of size
  s give those of size 2s in two batched matmuls; log2(C) steps, every one matmuls (C padded to a
  power of two with identity rows). Not `lax.linalg.triangular_solve`: jaxlib 0.10's CPU solve
  (a LAPACK custom call) was seen to hang on a second call of a jitted step at T = 4096."""
  C = L_XCC.shape[-1]
  size = 1 << max(C - 1, 0).bit_length()
  L_XPP = jnp.pad(L_XCC, [(0, 0)] * (L_XCC.ndim - 2) + [(0, size - C)] * 2)
  batch = L_XPP.shape[:-2]
  blocks_XNSS = jnp.ones((*batch, size, 1, 1), L_XCC.dtype)  # the inverted 1 x 1 diagonal
  s = 1
  while s < size:
    n = size // (2 * s)
    # L's diagonal blocks of size 2s, [..., n, 2s, 2s]; their lower-left s x s corner.
    tiles_X4 = L_XPP.reshape(*batch, n, 2 * s, n, 2 * s)
    lower_XNSS = jnp.einsum("...iaib->...iab", tiles_X4)[..., s:, :s]
    A_XNSS, D_XNSS = blocks_XNSS[..., 0::2, :, :], blocks_XNSS[..., 1::2, :, :]
    corner_XNSS = -jnp.matmul(D_XNSS, jnp.matmul(lower_XNSS, A_XNSS))
    top = jnp.concatenate([A_XNSS, jnp.zeros_like(A_XNSS)], axis=-1)
    bottom = jnp.concatenate([corner_XNSS, D_XNSS], axis=-1)
    blocks_XNSS = jnp.concatenate([top, bottom], axis=-2)
    s *= 2
  return blocks_XNSS[..., 0, :C, :C]


def _inverse_fwd(L_XCC):
  inverse_XCC = unit_lower_inverse(L_XCC)
  return inverse_XCC, inverse_XCC


def _inverse_bwd(inverse_XCC, d_inverse_XCC):
  """d(A^-1) = -A^-1 dA A^-1, so dL = -(A^-T dT A^-T), on L's strictly lower entries."""
  T_t = jnp.swapaxes(inverse_XCC, -1, -2)
  C = inverse_XCC.shape[-1]
  return (jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), -(T_t @ d_inverse_XCC @ T_t), 0.0),)


unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


@functools.partial(jax.checkpoint, static_argnums=(5,))
def prepare(k_NBHCK, v_NBHCV, g_NBHC, beta_NBHC, starts_NBC, delta: bool = True) -> Chunks:
  """Every chunk's W, U', Kd and gamma_C at once: one `[C, C]` triangular solve per chunk.
  Without the delta rule (`delta=False`: S <- exp(g) S + k v^T, beta unused) nothing is solved:
  U' = V and W = 0."""
  C, V = k_NBHCK.shape[-2], v_NBHCV.shape[-1]
  D_NBHCC, gamma_NBHC = _decays(g_NBHC, starts_NBC)
  if not delta:
    return Chunks(w_NBHCK=jnp.zeros_like(k_NBHCK), u_NBHCV=v_NBHCV,
                  kd_NBHCK=k_NBHCK * D_NBHCC[..., -1, :, None], decay_NBH=gamma_NBHC[..., -1])
  kk_NBHCC = jnp.einsum("nbhik,nbhjk->nbhij", k_NBHCK, k_NBHCK)
  strict_CC = jnp.tril(jnp.ones((C, C), bool), -1)
  L_NBHCC = jnp.where(strict_CC, beta_NBHC[..., :, None] * D_NBHCC * kk_NBHCC, 0.0)
  rhs_NBHCX = jnp.concatenate([beta_NBHC[..., None] * v_NBHCV,
                               (beta_NBHC * gamma_NBHC)[..., None] * k_NBHCK], axis=-1)
  x_NBHCX = jnp.matmul(unit_lower_inverse(L_NBHCC), rhs_NBHCX)  # (I + L) X = rhs
  return Chunks(w_NBHCK=x_NBHCX[..., V:], u_NBHCV=x_NBHCX[..., :V],
                kd_NBHCK=k_NBHCK * D_NBHCC[..., -1, :, None], decay_NBH=gamma_NBHC[..., -1])


def state_scan(chunks: Chunks, state_BHKV: jax.Array, *, unroll: int | bool = 1
               ) -> tuple[jax.Array, jax.Array]:
  """(the state entering each chunk `[N, B, H, K, V]`, the state after the last): a `lax.scan`
  of S <- gamma_C S + Kd^T (U' - W S) over the chunks (`unroll` as `lax.scan`'s: True lays
  every chunk's step out, as a FLOP count needs, since XLA's cost analysis counts a loop body
  once)."""
  @jax.checkpoint  # the backward recomputes U' - W S rather than keeping it per chunk
  def step(S_BHKV, chunk):
    w_BHCK, u_BHCV, kd_BHCK, decay_BH = chunk
    new_BHCV = u_BHCV - jnp.einsum("bhck,bhkv->bhcv", w_BHCK, S_BHKV)
    S_next = decay_BH[..., None, None] * S_BHKV + jnp.einsum("bhck,bhcv->bhkv", kd_BHCK, new_BHCV)
    return S_next, S_BHKV

  final_BHKV, entering_NBHKV = jax.lax.scan(step, state_BHKV, chunks, unroll=unroll)
  return entering_NBHKV, final_BHKV


@jax.checkpoint
def outputs(q_NBHCK, k_NBHCK, g_NBHC, starts_NBC, chunks: Chunks, entering_NBHKV) -> jax.Array:
  """O = diag(gamma) Q S_0 + (Q K^T * D) (U' - W S_0) for every chunk at once: `[N, B, H, C, V]`."""
  D_NBHCC, gamma_NBHC = _decays(g_NBHC, starts_NBC)
  new_NBHCV = chunks.u_NBHCV - jnp.einsum("nbhck,nbhkv->nbhcv", chunks.w_NBHCK, entering_NBHKV)
  scores_NBHCC = jnp.einsum("nbhik,nbhjk->nbhij", q_NBHCK, k_NBHCK) * D_NBHCC
  return (jnp.einsum("nbhck,nbhkv->nbhcv", q_NBHCK * gamma_NBHC[..., None], entering_NBHKV)
          + jnp.einsum("nbhij,nbhjv->nbhiv", scores_NBHCC, new_NBHCV))


Scan = Callable[[Chunks, jax.Array], tuple[jax.Array, jax.Array]]


def chunked(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, starts_BT, state_BHKV, chunk_size: int,
            scan: Scan = state_scan, delta: bool = True) -> tuple[jax.Array, jax.Array]:
  """(o `[B, T, H, V]`, final state `[B, H, K, V]`), both float32: the recurrence from
  `state_BHKV` (q already scaled), the state cut to 0 before every token where `starts_BT` is
  True (position 0 included). `scan` runs the states across chunks (`state_scan`, or a kernel's).
  `delta=False`: the gated linear recurrence S <- exp(g) S + k v^T (`beta_BTH` unused, may be
  None).

  T need not be a multiple of the chunk: the tail is padded with g = 0 (no decay), beta = 0 (no
  write) and no document start, tokens that leave the state as it is.
  """
  B, T, H, _ = q_BTHK.shape
  C = min(chunk_size, T)
  pad = -T % C
  padded = lambda x: jnp.pad(x.astype(F32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  if beta_BTH is None:  # (the linear recurrence writes with strength 1)
    beta_BTH = jnp.ones(g_BTH.shape, F32)
  q, k, v, g, beta = (to_chunks(padded(x), C) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH))
  starts = jnp.zeros((B, T), bool) if starts_BT is None else starts_BT
  starts_NBC = jnp.swapaxes(jnp.pad(starts, ((0, 0), (0, pad))).reshape(B, -1, C), 0, 1)
  chunks = prepare(k, v, g, beta, starts_NBC, delta)
  entering_NBHKV, final_BHKV = scan(chunks, state_BHKV.astype(F32))
  o_NBHCV = outputs(q, k, g, starts_NBC, chunks, entering_NBHKV)
  return from_chunks(o_NBHCV)[:, :T], final_BHKV
