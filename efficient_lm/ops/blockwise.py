"""The one blockwise attention core behind every local op (block-local, sliding window, π).

The sequence is cut into N blocks of L tokens (padded at the end). Block b's
queries see the keys of blocks b - lookback .. b: M = (lookback + 1) * L keys
each, gathered by shifting whole blocks (no gather, no `[T, T]` array). A
static `[L, M]` band mask keeps j <= i (and j > i - window); keys before the
sequence start are masked per block. Cost and memory are O(T * M).

Optionally the softmax also covers per-token extra keys (π-Attention's skips):
`extra_logits_BTHS` with values `extra_v_BTSHK`, fused with the local part by
one log-sum-exp, and a per-token bias added to every local logit.
"""

import jax
import jax.numpy as jnp

MASKED = -1e30  # finite, so a log-prior added to it cannot make inf - inf


def split_blocks(x_BT: jax.Array, block_size: int) -> jax.Array:
  """`[B, T, ...]` -> `[B, N, L, ...]`, zero-padding T up to a multiple of L."""
  B, T = x_BT.shape[:2]
  N = -(-T // block_size)
  pad = [(0, 0), (0, N * block_size - T)] + [(0, 0)] * (x_BT.ndim - 2)
  return jnp.pad(x_BT, pad).reshape(B, N, block_size, *x_BT.shape[2:])


def merge_blocks(x_BNL: jax.Array, T: int) -> jax.Array:
  """`[B, N, L, ...]` -> `[B, T, ...]`, dropping the padding."""
  B, N, L = x_BNL.shape[:3]
  return x_BNL.reshape(B, N * L, *x_BNL.shape[3:])[:, :T]


def with_previous_blocks(x_BNLHK: jax.Array, lookback: int) -> jax.Array:
  """Block b's keys: blocks b - lookback .. b concatenated, `[B, N, (lookback + 1) * L, H, K]`.

  Blocks before the first are zeros (and are masked by the caller).
  """
  if lookback == 0:
    return x_BNLHK
  N = x_BNLHK.shape[1]
  padded = jnp.pad(x_BNLHK, [(0, 0), (lookback, 0)] + [(0, 0)] * (x_BNLHK.ndim - 2))
  shifted = [padded[:, lookback - s:lookback - s + N] for s in range(lookback, -1, -1)]
  return jnp.concatenate(shifted, axis=2)


def band_mask(block_size: int, lookback: int, window: int | None, num_blocks: int,
              first_key: int | jax.Array = 0) -> jax.Array:
  """`[N, L, M]` bool: query i = b*L + r may see key j = (b - lookback)*L + c.

  j <= i always; i - window < j if `window`; j >= first_key (0: the first blocks'
  lookback; a context-parallel halo from before the sequence start sets it higher).
  """
  L, M = block_size, (lookback + 1) * block_size
  r = jnp.arange(L)[:, None]
  c = jnp.arange(M)[None, :]
  offset = c - lookback * L - r  # j - i
  allowed_LM = offset <= 0
  if window is not None:
    allowed_LM &= offset > -window
  key_NM = (jnp.arange(num_blocks)[:, None] - lookback) * L + c  # j
  return allowed_LM[None] & (key_NM >= first_key)[:, None, :]


def blockwise_attention(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHK: jax.Array,
    *,
    block_size: int,
    lookback: int,
    window: int | None = None,
    scale: float | None = None,
    local_bias_BTH: jax.Array | None = None,
    extra_logits_BTHS: jax.Array | None = None,
    extra_v_BTSHK: jax.Array | None = None,
    first_key: int | jax.Array = 0,
) -> jax.Array:
  """Softmax attention over each token's local block band (plus optional extra keys).

  `extra_logits_BTHS` must already be scaled and masked (use `MASKED` for absent keys).
  Keys before `first_key` (a traced scalar is fine) are masked for every query.
  """
  B, T, H, K = q_BTHK.shape
  L = block_size
  scale = K ** -0.5 if scale is None else scale
  q_BNLHK = split_blocks(q_BTHK, L)
  N = q_BNLHK.shape[1]
  k_BNMHK = with_previous_blocks(split_blocks(k_BTHK, L), lookback)
  v_BNMHK = with_previous_blocks(split_blocks(v_BTHK, L), lookback)

  logits_BNHLM = jnp.einsum("bnlhk,bnmhk->bnhlm", q_BNLHK, k_BNMHK,
                            preferred_element_type=jnp.float32) * scale
  if local_bias_BTH is not None:
    bias_BNLH = split_blocks(local_bias_BTH.astype(jnp.float32), L)
    logits_BNHLM = logits_BNHLM + jnp.transpose(bias_BNLH, (0, 1, 3, 2))[..., None]
  mask_1NLM = band_mask(L, lookback, window, N, first_key)[None]
  logits_BNHLM = jnp.where(mask_1NLM[:, :, None], logits_BNHLM, MASKED)

  if extra_logits_BTHS is None:
    probs_BNHLM = jax.nn.softmax(logits_BNHLM, axis=-1)
    o_BNLHK = jnp.einsum("bnhlm,bnmhk->bnlhk", probs_BNHLM.astype(v_BTHK.dtype), v_BNMHK)
    return merge_blocks(o_BNLHK, T)

  # One softmax over local and extra logits, fused by log-sum-exp.
  extra_BNLHS = split_blocks(extra_logits_BTHS.astype(jnp.float32), L)
  extra_BNHLS = jnp.transpose(extra_BNLHS, (0, 1, 3, 2, 4))
  peak_BNHL1 = jnp.maximum(jnp.max(logits_BNHLM, axis=-1, keepdims=True),
                           jnp.max(extra_BNHLS, axis=-1, keepdims=True))
  peak_BNHL1 = jax.lax.stop_gradient(peak_BNHL1)
  local_BNHLM = jnp.exp(logits_BNHLM - peak_BNHL1)
  extra_BNHLS = jnp.exp(extra_BNHLS - peak_BNHL1)
  denom_BNHL = jnp.sum(local_BNHLM, axis=-1) + jnp.sum(extra_BNHLS, axis=-1)
  o_BNLHK = jnp.einsum("bnhlm,bnmhk->bnlhk", local_BNHLM.astype(v_BTHK.dtype), v_BNMHK)
  extra_v_BNLSHK = split_blocks(extra_v_BTSHK, L)
  o_BNLHK = o_BNLHK + jnp.einsum("bnhls,bnlshk->bnlhk", extra_BNHLS.astype(v_BTHK.dtype),
                                 extra_v_BNLSHK)
  o_BNLHK = o_BNLHK / jnp.transpose(denom_BNHL, (0, 1, 3, 2))[..., None].astype(o_BNLHK.dtype)
  return merge_blocks(o_BNLHK, T)
