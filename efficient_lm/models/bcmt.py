"""BCMT, the Blockwise Causal Memory Transformer: block-local attention plus an exponential memory.

Per layer, for x_BTD cut into N blocks of L tokens:

1. h = local causal attention inside each block (`block_local_attention`, lookback 0).
2. s[b] = sum over block b of softmax_L(h @ w_pool) * h      (learned pooling, w_pool: D -> 1).
3. m = exponential_memory(s, alpha)                           (normalized, inclusive).
4. p[b] = W_m m[b - 1], p[0] = 0                              (project, shift by one block).
5. out = h + g * p, g = sigmoid(W_g [h; p] + b_g)             (p broadcast over the block).

The gate's `W_g [h; p]` is computed as `W_gh h + W_gp p` (the same function):
the `p` half runs once per block instead of once per token. The shift is what
keeps the model causal: s[b] pools over all of block b, its own future included.
`HOnly` (the ablation) is step 1 alone.

Streaming decoding (`init_cache`, `prefill`, `extend` / `step`) keeps, per layer,
the current block's keys and values, the current block's pooling as an online
softmax (running max, normalizer, weighted sum) and the memory's (numerator,
denominator): its size does not depend on how many tokens have been generated.
`prefill` runs the parallel pass over a prompt and derives that state from it.
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from efficient_lm import sharding
from efficient_lm.models import chunking
from efficient_lm.models import layers
from efficient_lm.ops import blockwise
from efficient_lm.ops import op_set
from efficient_lm.ops.pattern import Pattern
from efficient_lm.validation import divisors_near, require, require_positive_int

# Its parameters' own logical axes (the registry entry declares them): the pooling logit, the
# memory projection (sharded over fsdp) and the gate (over tensor).
LOGICAL_AXES = {
    "pool": sharding.Axis("1"),
    "memory": sharding.Axis("model.d_model", "fsdp"),
    "gate": sharding.Axis("model.d_model", "tensor"),
}


class Bcmt(nnx.Module):
  """The BCMT mixer; `use_memory=False` is HOnly (local attention only)."""

  def __init__(self, d_model: int, num_heads: int, *, block_size: int, alpha: float,
               use_memory: bool, use_rope: bool, rope_base: float, dtype, rngs: nnx.Rngs,
               ops: op_set.OpSet = op_set.SINGLE_DEVICE):
    self.d_model = d_model
    self.ops = ops
    self.num_heads = num_heads
    self.block_size = block_size
    self.alpha = alpha
    self.use_memory = use_memory
    self.dtype = dtype
    op = functools.partial(ops.block_local_attention, block_size=block_size)
    self.attn = layers.SelfAttention(d_model, num_heads, op, use_rope=use_rope,
                                     rope_base=rope_base, dtype=dtype, rngs=rngs, attend=ops.attend)
    if use_memory:
      linear = functools.partial(nnx.Linear, dtype=dtype, rngs=rngs)
      self.pool = linear(d_model, 1, use_bias=False,          # w_pool
                         kernel_metadata=layers.axes("embed", "pool"))
      self.memory_proj = linear(d_model, d_model, use_bias=False,  # W_m
                                kernel_metadata=layers.axes("embed", "memory"))
      self.gate_h = linear(d_model, d_model, use_bias=True,   # W_g's h half, and b_g
                           kernel_metadata=layers.axes("embed", "gate"),
                           bias_metadata=layers.axes("gate"))
      self.gate_p = linear(d_model, d_model, use_bias=False,  # W_g's p half
                           kernel_metadata=layers.axes("memory", "gate"))

  def fuse(self, h_BTD: jax.Array, p_BND: jax.Array) -> jax.Array:
    """out = h + sigmoid(W_gh h + W_gp p + b_g) * p, p broadcast over each block's tokens."""
    B, T, D = h_BTD.shape
    L = self.block_size
    expand = lambda x_BND: blockwise.merge_blocks(
        jnp.broadcast_to(x_BND[:, :, None], (B, x_BND.shape[1], L, D)), T)
    gate_BTD = jax.nn.sigmoid(self.gate_h(h_BTD) + expand(self.gate_p(p_BND)))
    return h_BTD + gate_BTD * expand(p_BND)

  def pool_logits(self, h_BND: jax.Array) -> jax.Array:
    """The pooling logit h . w_pool of every token, computed in float32 (`[B, N]` for `[B, N, D]`)."""
    return jnp.einsum("...d,d->...", h_BND.astype(jnp.float32),
                      self.pool.kernel[...][:, 0].astype(jnp.float32))

  def summaries(self, h_BNLD: jax.Array) -> jax.Array:
    """s_BND: each block's tokens pooled by a learned softmax, all in float32."""
    weights_BNL = jax.nn.softmax(self.pool_logits(h_BNLD), axis=-1)
    return jnp.einsum("bnl,bnld->bnd", weights_BNL, h_BNLD.astype(jnp.float32))

  def block_memory(self, h_BTD: jax.Array) -> jax.Array:
    """p_BND: block b's injected memory, the projection of m[b - 1] (zeros for b = 0)."""
    h_BNLD = blockwise.split_blocks(h_BTD, self.block_size)  # a ragged last block is never read
    N = h_BNLD.shape[1]
    if N == 1:
      return jnp.zeros((h_BTD.shape[0], 1, self.d_model), h_BTD.dtype)
    # Every block's summary, though the last one's only feeds block N (the shift drops it):
    # N then stays a multiple of the context-parallel devices.
    return self.memory_from_summaries(self.summaries(h_BNLD), h_BTD.dtype)

  def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array) -> jax.Array:
    h_BTD = self.attn(x_BTD, positions_BT)
    if not self.use_memory:
      return h_BTD
    return self.fuse(h_BTD, self.block_memory(h_BTD))

  def memory_from_summaries(self, s_BND: jax.Array, dtype) -> jax.Array:
    """p_BND: block b's injected memory, the projection of m[b - 1] (zeros for b = 0)."""
    m_BND = self.ops.exponential_memory(s_BND, self.alpha)
    return self.ops.shift_right(self.memory_proj(m_BND.astype(dtype)), 1)

  # Sequence-chunked blocks (`models/chunking.py`): chunks hold whole blocks. A first pass over the
  # chunks computes each chunk's local attention and pools each block's summary; the memory runs
  # over all of them; the block's own pass fuses each chunk's local attention (kept from the first
  # pass: one `[B, T, D]` array, so each chunk's keys, values and attention are computed once) with
  # that chunk's memory. HOnly has no first pass: its block pass attends.

  @property
  def chunk_pattern(self) -> Pattern:
    return Pattern.blocks(self.block_size)

  def keys_values(self, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    return self.attn.keys_values(x_BTD, positions_BT)

  def _local(self, x_BCD, positions_BC, k_BWHK, v_BWHK, q_start, k_offset, q_align) -> jax.Array:
    return self.attn.attend_window(self.attn.queries(x_BCD, positions_BC), k_BWHK, v_BWHK,
                                   q_start, k_offset, q_align, self.chunk_pattern)

  def chunk_context(self, window, x_nBCD, positions_nBC, xh_nBHD, ph_nBH, starts_n, halo: int,
                    chunk: int):
    """(each chunk's local attention `[n, B, C, D]`, the memory its blocks receive
    `[n, B, C / L, D]`), or None for HOnly.

    `window(x_BCD, positions_BC, xh_BHD, ph_BH)` is the block's own: (normed chunk inputs, keys,
    values of the halo and the chunk), from the chunk and its halo's inputs `xh_nBHD`."""
    if not self.use_memory:
      return None
    L = self.block_size

    def local_and_summaries(x_BCD, positions_BC, xh_BHD, ph_BH, start):
      h_BCD, k_BWHK, v_BWHK = window(x_BCD, positions_BC, xh_BHD, ph_BH)
      h_BCD = self._local(h_BCD, positions_BC, k_BWHK, v_BWHK, start, -halo, chunk)
      return h_BCD, self.summaries(blockwise.split_blocks(h_BCD, L))

    h_nBCD, s_nBcD = chunking.map_chunks(local_and_summaries, x_nBCD, positions_nBC, xh_nBHD,
                                         ph_nBH, starts_n)
    p_BND = self.memory_from_summaries(chunking.merge(s_nBcD), x_nBCD.dtype)
    return h_nBCD, chunking.split(p_BND, x_nBCD.shape[2] // L)

  def attend_chunk(self, x_BCD, positions_BC, k_BWHK, v_BWHK, q_start, k_offset, q_align,
                   context=None):
    if context is not None:  # the local attention came with the memory: the inputs go unused
      h_BCD, p_BcD = context  # (and XLA drops the block pass's keys and values)
      return self.fuse(h_BCD, p_BcD)
    return self._local(x_BCD, positions_BC, k_BWHK, v_BWHK, q_start, k_offset, q_align)

  # Streaming decoding.

  def init_cache(self, batch_size: int, max_len: int = 0) -> dict:
    """Constant size: `max_len` is not needed."""
    del max_len
    B, L, H, D = batch_size, self.block_size, self.num_heads, self.d_model
    cache = layers.kv_cache_init(B, L, H, D // H, self.dtype)  # the open block's keys/values
    if self.use_memory:
      f32 = jnp.float32
      cache.update(pool_max=jnp.full((B,), -jnp.inf, f32), pool_norm=jnp.zeros((B,), f32),
                   pool_sum=jnp.zeros((B, D), f32), num=jnp.zeros((B, D), f32),
                   den=jnp.zeros((B,), f32))
    return cache

  def step(self, x_B1D: jax.Array, position: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """One token at `position` (a scalar, the same for the whole batch)."""
    B, _, D = x_B1D.shape
    L = self.block_size
    offset = position % L
    pos_1, positions_B1 = layers.chunk_positions(position, B, 1)
    q_B1HK, k_B1HK, v_B1HK = self.attn.project(x_B1D, positions_B1)
    k_NLK, v_NLK, pos_L, ring = layers.kv_cache_extend(cache, k_B1HK, v_B1HK, pos_1)
    o_B1HK = layers.cached_attention(q_B1HK, k_NLK, v_NLK, pos_L, Pattern.blocks(L), position)
    h_B1D = self.attn.out(o_B1HK.reshape(B, 1, D))
    cache = dict(cache, **ring)
    if not self.use_memory:
      return h_B1D, cache

    # The memory of the blocks before this one, projected (zeros in block 0).
    den_B = cache["den"]
    m_BD = jnp.where(den_B[:, None] > 0, cache["num"] / jnp.maximum(den_B, 1e-30)[:, None], 0.0)
    p_B1D = self.memory_proj(m_BD.astype(h_B1D.dtype))[:, None]
    gate_B1D = jax.nn.sigmoid(self.gate_h(h_B1D) + self.gate_p(p_B1D))
    y_B1D = h_B1D + gate_B1D * p_B1D

    # This block's pooled summary, as an online softmax; at the block's end it enters the memory.
    logit_B = self.pool_logits(h_B1D)[:, 0]
    new_max_B = jnp.maximum(cache["pool_max"], logit_B)
    old_scale_B = jnp.exp(cache["pool_max"] - new_max_B)
    new_scale_B = jnp.exp(logit_B - new_max_B)
    norm_B = cache["pool_norm"] * old_scale_B + new_scale_B
    sum_BD = (cache["pool_sum"] * old_scale_B[:, None]
              + new_scale_B[:, None] * h_B1D[:, 0].astype(jnp.float32))
    done = offset == L - 1
    s_BD = sum_BD / norm_B[:, None]
    cache.update(
        num=jnp.where(done, self.alpha * cache["num"] + s_BD, cache["num"]),
        den=jnp.where(done, self.alpha * den_B + 1.0, den_B),
        pool_max=jnp.where(done, -jnp.inf, new_max_B),
        pool_norm=jnp.where(done, 0.0, norm_B),
        pool_sum=jnp.where(done, 0.0, sum_BD))
    return y_B1D, cache


  def extend(self, x_BCD: jax.Array, start: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """C tokens from `start`, one `step` after another (the state is sequential by nature)."""
    def body(cache, x_and_position):
      x_BD, position = x_and_position
      y_B1D, cache = self.step(x_BD[:, None], position, cache)
      return cache, y_B1D[:, 0]

    C = x_BCD.shape[1]
    positions_C = jnp.asarray(start, jnp.int32) + jnp.arange(C, dtype=jnp.int32)
    if C == 1:
      y_B1D, cache = self.step(x_BCD, positions_C[0], cache)
      return y_B1D, cache
    cache, y_CBD = jax.lax.scan(body, cache, (jnp.swapaxes(x_BCD, 0, 1), positions_C))
    return jnp.swapaxes(y_CBD, 0, 1), cache

  def prefill(self, x_BTD: jax.Array, positions_BT: jax.Array, cache: dict
              ) -> tuple[jax.Array, dict]:
    """The parallel pass over a prompt at positions 0..T-1, and the state `step` continues from:
    the open block's keys/values and pooling, the memory of the closed blocks."""
    B, T, D = x_BTD.shape
    L = self.block_size
    closed = T // L
    q_BTHK, k_BTHK, v_BTHK = self.attn.project(x_BTD, positions_BT)
    h_BTD = self.attn.out(self.attn.op(q_BTHK, k_BTHK, v_BTHK).reshape(B, T, D))
    open_len = T - closed * L
    cache = dict(cache, **layers.kv_cache_write(cache, k_BTHK, v_BTHK, positions_BT[0]))
    if not self.use_memory:
      return h_BTD, cache
    y_BTD = self.fuse(h_BTD, self.block_memory(h_BTD))
    if closed:  # num = sum_b alpha^(closed-1-b) s_b, den the same sum of ones
      s_BND = self.summaries(blockwise.split_blocks(h_BTD[:, :closed * L], L))
      decay_N = self.alpha ** jnp.arange(closed - 1, -1, -1, dtype=jnp.float32)
      cache.update(num=jnp.einsum("n,bnd->bd", decay_N, s_BND),
                   den=jnp.full((B,), decay_N.sum(), jnp.float32))
    if open_len:  # the open block's pooling so far, as the online softmax `step` keeps
      h_BOD = h_BTD[:, closed * L:].astype(jnp.float32)
      logits_BO = self.pool_logits(h_BTD[:, closed * L:])
      max_B = logits_BO.max(axis=-1)
      scale_BO = jnp.exp(logits_BO - max_B[:, None])
      cache.update(pool_max=max_B, pool_norm=scale_BO.sum(axis=-1),
                   pool_sum=jnp.einsum("bo,bod->bd", scale_BO, h_BOD))
    return y_BTD, cache


def _mixer(cfg: ml_collections.ConfigDict, rngs: nnx.Rngs, *, use_memory: bool,
           ops: op_set.OpSet) -> Bcmt:
  return Bcmt(cfg.d_model, cfg.num_heads, block_size=cfg.block_size,
              alpha=cfg.alpha, use_memory=use_memory,
              use_rope=cfg.position == "rope", rope_base=cfg.rope_base,
              dtype=layers.dtype_of(cfg.dtype), rngs=rngs, ops=ops)


def make_mixer(cfg: ml_collections.ConfigDict, layer: int, rngs: nnx.Rngs, *,
               ops: op_set.OpSet = op_set.SINGLE_DEVICE) -> nnx.Module:
  del layer  # every layer is the same
  return _mixer(cfg, rngs, use_memory=True, ops=ops)


def make_honly_mixer(cfg: ml_collections.ConfigDict, layer: int, rngs: nnx.Rngs, *,
                     ops: op_set.OpSet = op_set.SINGLE_DEVICE) -> nnx.Module:
  del layer
  return _mixer(cfg, rngs, use_memory=False, ops=ops)


def validate_honly(cfg: ml_collections.ConfigDict) -> None:
  require_positive_int("model.block_size", cfg.get("block_size"))
  near = divisors_near(cfg.seq_len, cfg.block_size)
  require(cfg.seq_len % cfg.block_size == 0, "model.block_size", cfg.block_size,
          f"must divide data.seq_len={cfg.seq_len}",
          f"use a divisor of {cfg.seq_len} such as {', '.join(map(str, near[:-1]))} or {near[-1]}, "
          "or change data.seq_len")


def validate(cfg: ml_collections.ConfigDict) -> None:
  validate_honly(cfg)
  alpha = cfg.get("alpha")
  require(isinstance(alpha, float) and 0.0 < alpha < 1.0, "model.alpha", alpha,
          "must be a float in (0, 1)", "set model.alpha to e.g. 0.8 (the paper's value)")
