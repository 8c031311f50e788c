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
`HOnly` (the ablation) is step 1 alone. With documents (`segment_ids`) the memory
restarts at a document's first block (the `Bcmt` docstring says exactly how).

Streaming decoding (`init_cache`, `prefill`, `extend` / `step`) keeps, per layer,
the current block's keys and values, the current block's pooling as an online
softmax (running max, normalizer, weighted sum) and the memory's (numerator,
denominator): its size does not depend on how many tokens have been generated.
`prefill` runs the parallel pass over a prompt and derives that state from it.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from efficient_lm.config import axes
from efficient_lm.config.model import ModelConfig
from efficient_lm.models import chunking
from efficient_lm.models import layers
from efficient_lm.models import registry
from efficient_lm.ops import blockwise
from efficient_lm.ops import memory
from efficient_lm.ops.pattern import Pattern
from efficient_lm.ops.route import DEFAULT as DEFAULT_ROUTE, Route

# Its parameters' own logical axes (the registry entry declares them): the pooling logit, the
# memory projection (sharded over fsdp) and the gate (over tensor).
LOGICAL_AXES = axes.FAMILY_AXES["bcmt"]  # (declared without jax: efficient_lm/config/axes.py)


class Bcmt(nnx.Module):
  """The BCMT mixer; `use_memory=False` is HOnly (local attention only).

  Documents (`segment_ids`): the local attention stays inside each document; a block's summary
  pools only the tokens of the document its last token belongs to (its *end* document); the
  memory restarts at a block whose end document differs from the previous block's; and a
  token receives the memory of the blocks before its own only when it belongs to the end
  document of the block before (else zeros: a document's first, partial block has no memory).
  """

  def __init__(self, d_model: int, num_heads: int, *, block_size: int, alpha: float,
               use_memory: bool, use_rope: bool, rope_base: float, dtype, rngs: nnx.Rngs,
               route: Route, num_kv_heads: int | None = None):
    self.d_model = d_model
    self.route = route
    self.num_heads = num_heads
    self.block_size = block_size
    self.alpha = alpha
    self.use_memory = use_memory
    self.dtype = dtype
    self.attn = layers.SelfAttention(d_model, num_heads, Pattern.blocks(block_size), route=route,
                                     use_rope=use_rope, rope_base=rope_base, dtype=dtype,
                                     rngs=rngs, num_kv_heads=num_kv_heads)
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

  @property
  def patterns(self) -> tuple[Pattern, ...]:
    return self.attn.patterns

  def fuse(self, h_BTD: jax.Array, p_BND: jax.Array, reads_BT: jax.Array | None = None
           ) -> jax.Array:
    """out = h + sigmoid(W_gh h + W_gp p + b_g) * p, p broadcast over each block's tokens (and
    zero for the tokens where `reads_BT` is False)."""
    B, T, D = h_BTD.shape
    L = self.block_size
    expand = lambda x_BND: blockwise.merge_blocks(
        jnp.broadcast_to(x_BND[:, :, None], (B, x_BND.shape[1], L, D)), T)
    p_BTD, gp_BTD = expand(p_BND), expand(self.gate_p(p_BND))
    if reads_BT is not None:  # W_gp is linear without a bias: W_gp (r p) = r W_gp p
      reads_BT = reads_BT[:, :T]  # a ragged last block's padding dropped
      p_BTD = jnp.where(reads_BT[..., None], p_BTD, 0).astype(p_BTD.dtype)
      gp_BTD = jnp.where(reads_BT[..., None], gp_BTD, 0).astype(gp_BTD.dtype)
    gate_BTD = jax.nn.sigmoid(self.gate_h(h_BTD) + gp_BTD)
    return h_BTD + gate_BTD * p_BTD

  def pool_logits(self, h_BND: jax.Array) -> jax.Array:
    """The pooling logit h . w_pool of every token, computed in float32 (`[B, N]` for `[B, N, D]`)."""
    return jnp.einsum("...d,d->...", h_BND.astype(jnp.float32),
                      self.pool.kernel[...][:, 0].astype(jnp.float32))

  def summaries(self, h_BNLD: jax.Array, seg_BNL: jax.Array | None = None) -> jax.Array:
    """s_BND: each block's tokens pooled by a learned softmax, all in float32; with documents
    only the tokens of the block's end document."""
    logits_BNL = self.pool_logits(h_BNLD)
    if seg_BNL is not None:
      logits_BNL = jnp.where(seg_BNL == seg_BNL[..., -1:], logits_BNL, -jnp.inf)
    weights_BNL = jax.nn.softmax(logits_BNL, axis=-1)
    return jnp.einsum("bnl,bnld->bnd", weights_BNL, h_BNLD.astype(jnp.float32))

  def block_memory(self, h_BTD: jax.Array, segment_ids_BT: jax.Array | None = None):
    """(p_BND: block b's injected memory, the projection of m[b - 1], zeros for b = 0; which
    tokens read it `[B, T]`, None without documents)."""
    h_BNLD = blockwise.split_blocks(h_BTD, self.block_size)  # a ragged last block is never read
    N = h_BNLD.shape[1]
    if N == 1:
      return jnp.zeros((h_BTD.shape[0], 1, self.d_model), h_BTD.dtype), None
    seg_BNL = None
    if segment_ids_BT is not None:
      seg_BNL = blockwise.split_blocks(segment_ids_BT.astype(jnp.int32), self.block_size)
    # Every block's summary, though the last one's only feeds block N (the shift drops it):
    # N then stays a multiple of the context-parallel devices.
    return self.memory_from_summaries(self.summaries(h_BNLD, seg_BNL), h_BTD.dtype, seg_BNL)

  def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array,
               segment_ids_BT: jax.Array | None = None) -> jax.Array:
    h_BTD = self.attn(x_BTD, positions_BT, segment_ids_BT)
    if not self.use_memory:
      return h_BTD
    return self.fuse(h_BTD, *self.block_memory(h_BTD, segment_ids_BT))

  def memory_from_summaries(self, s_BND: jax.Array, dtype, seg_BNL: jax.Array | None = None):
    """(p_BND, reads_BT or None): block b's injected memory, the projection of m[b - 1] (zeros
    for b = 0), and with documents (`seg_BNL`) which tokens read it."""
    keep_BN = reads_BT = None
    if seg_BNL is not None:
      end_BN = seg_BNL[:, :, -1]
      before_BN = self.route.shift_right(end_BN, 1)  # the end document of the block before
      keep_BN = end_BN == before_BN                  # (block 0 has no state to keep)
      reads_BNL = seg_BNL == before_BN[..., None]
      reads_BT = reads_BNL.reshape(reads_BNL.shape[0], -1)
    m_BND = self.route.exponential_memory(s_BND, self.alpha, keep_BN)
    return self.route.shift_right(self.memory_proj(m_BND.astype(dtype)), 1), reads_BT

  # Sequence-chunked blocks (`models/chunking.py`): chunks hold whole blocks. A first pass over the
  # chunks computes each chunk's local attention and pools each block's summary; the memory runs
  # over all of them; the block's own pass fuses each chunk's local attention (kept from the first
  # pass: one `[B, T, D]` array, so each chunk's keys, values and attention are computed once) with
  # that chunk's memory. HOnly has no first pass: its block pass attends.

  def keys_values(self, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    return self.attn.keys_values(x_BTD, positions_BT)

  def attend_chunk(self, x_BCD, positions_BC, k_BWHK, v_BWHK, q_start, k_offset, q_align,
                   segment_ids=None) -> jax.Array:
    return self.attn.attend_chunk(x_BCD, positions_BC, k_BWHK, v_BWHK, q_start, k_offset,
                                  q_align, segment_ids)

  def chunk_context(self, window, x_nBCD, positions_nBC, xh_nBHD, ph_nBH, seg_n, starts_n,
                    halo: int, chunk: int):
    """(each chunk's local attention `[n, B, C, D]`, the memory its blocks receive
    `[n, B, C / L, D]`, which of its tokens read it `[n, B, C]` or None), or None for HOnly.

    `window(x_BCD, positions_BC, xh_BHD, ph_BH)` is the block's own: (normed chunk inputs, keys,
    values of the halo and the chunk), from the chunk and its halo's inputs `xh_nBHD`; `seg_n`
    the chunks' and their windows' document ids, or (None, None)."""
    if not self.use_memory:
      return None
    L = self.block_size

    def local_and_summaries(x_BCD, positions_BC, xh_BHD, ph_BH, seg, start):
      h_BCD, k_BWHK, v_BWHK = window(x_BCD, positions_BC, xh_BHD, ph_BH)
      ids = None if seg[0] is None else seg
      h_BCD = self.attend_chunk(h_BCD, positions_BC, k_BWHK, v_BWHK, start, -halo, chunk, ids)
      seg_BcL = None if ids is None else blockwise.split_blocks(ids[0], L)
      return h_BCD, self.summaries(blockwise.split_blocks(h_BCD, L), seg_BcL)

    h_nBCD, s_nBcD = chunking.map_chunks(local_and_summaries, x_nBCD, positions_nBC, xh_nBHD,
                                         ph_nBH, seg_n, starts_n)
    seg_BNL = None
    if seg_n[0] is not None:
      seg_BNL = blockwise.split_blocks(chunking.merge(seg_n[0]), L)
    p_BND, reads_BT = self.memory_from_summaries(chunking.merge(s_nBcD), x_nBCD.dtype, seg_BNL)
    reads_nBC = None if reads_BT is None else chunking.split(reads_BT, chunk)
    return h_nBCD, chunking.split(p_BND, chunk // L), reads_nBC

  def attend_chunk_with(self, context, x_BCD, positions_BC, k_BWHK, v_BWHK, q_start, k_offset,
                        q_align, segment_ids=None) -> jax.Array:
    """The local attention came with the memory: the inputs go unused (and XLA drops the block
    pass's keys and values)."""
    h_BCD, p_BcD, reads_BC = context
    return self.fuse(h_BCD, p_BcD, reads_BC)

  # Streaming decoding.

  def init_cache(self, batch_size: int, max_len: int = 0) -> dict:
    """Constant size: `max_len` is not needed."""
    del max_len
    B, D = batch_size, self.d_model
    cache = self.attn.init_cache(B, self.block_size)  # the open block's keys/values
    if self.use_memory:
      f32 = jnp.float32
      cache.update(pool_max=jnp.full((B,), -jnp.inf, f32), pool_norm=jnp.zeros((B,), f32),
                   pool_sum=jnp.zeros((B, D), f32), pool_seg=jnp.full((B,), -1, jnp.int32),
                   num=jnp.zeros((B, D), f32), den=jnp.zeros((B,), f32),
                   mem_seg=jnp.full((B,), -1, jnp.int32))
    return cache

  def step(self, x_B1D: jax.Array, position: jax.Array, cache: dict,
           seg_B1: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """One token at `position` (a scalar, the same for the whole batch) of documents `seg_B1`."""
    B, _, D = x_B1D.shape
    L = self.block_size
    offset = position % L
    seg_B1 = layers.document_ids(seg_B1, B, 1)
    kv = {name: cache[name] for name in ("k", "v", "pos", "seg")}
    h_B1D, kv = self.attn.extend(x_B1D, position, kv, seg_B1)
    cache = dict(cache, **kv)
    if not self.use_memory:
      return h_B1D, cache

    # The memory of the blocks before this one, projected (zeros in block 0, and for a token of
    # another document than the memory's).
    den_B, seg_B = cache["den"], seg_B1[:, 0]
    reads_B = (den_B > 0) & (cache["mem_seg"] == seg_B)
    m_BD = jnp.where(reads_B[:, None], cache["num"] / jnp.maximum(den_B, 1e-30)[:, None], 0.0)
    p_B1D = self.memory_proj(m_BD.astype(h_B1D.dtype))[:, None]
    gate_B1D = jax.nn.sigmoid(self.gate_h(h_B1D) + self.gate_p(p_B1D))
    y_B1D = h_B1D + gate_B1D * p_B1D

    # This block's pooled summary, as an online softmax restarted at each new document; at the
    # block's end it enters the memory (which restarts when the block's end document is new).
    fresh_B = cache["pool_seg"] != seg_B
    pool_max_B = jnp.where(fresh_B, -jnp.inf, cache["pool_max"])
    pool_norm_B = jnp.where(fresh_B, 0.0, cache["pool_norm"])
    pool_sum_BD = jnp.where(fresh_B[:, None], 0.0, cache["pool_sum"])
    logit_B = self.pool_logits(h_B1D)[:, 0]
    new_max_B = jnp.maximum(pool_max_B, logit_B)
    old_scale_B = jnp.exp(pool_max_B - new_max_B)
    new_scale_B = jnp.exp(logit_B - new_max_B)
    norm_B = pool_norm_B * old_scale_B + new_scale_B
    sum_BD = pool_sum_BD * old_scale_B[:, None] + new_scale_B[:, None] * h_B1D[:, 0].astype(jnp.float32)
    done = offset == L - 1
    s_BD = sum_BD / norm_B[:, None]
    keep_B = jnp.where(cache["mem_seg"] == seg_B, self.alpha, 0.0)
    cache.update(
        num=jnp.where(done, keep_B[:, None] * cache["num"] + s_BD, cache["num"]),
        den=jnp.where(done, keep_B * den_B + 1.0, den_B),
        mem_seg=jnp.where(done, seg_B, cache["mem_seg"]),
        pool_max=jnp.where(done, -jnp.inf, new_max_B),
        pool_norm=jnp.where(done, 0.0, norm_B),
        pool_sum=jnp.where(done, 0.0, sum_BD),
        pool_seg=jnp.where(done, -1, seg_B))
    return y_B1D, cache

  def extend(self, x_BCD: jax.Array, start: jax.Array, cache: dict,
             segment_ids_BC: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """C tokens from `start`, one `step` after another (the state is sequential by nature)."""
    B, C, _ = x_BCD.shape
    seg_BC = layers.document_ids(segment_ids_BC, B, C)
    positions_C = jnp.asarray(start, jnp.int32) + jnp.arange(C, dtype=jnp.int32)
    if C == 1:
      return self.step(x_BCD, positions_C[0], cache, seg_BC)

    def body(cache, inputs):
      x_BD, position, seg_B = inputs
      y_B1D, cache = self.step(x_BD[:, None], position, cache, seg_B[:, None])
      return cache, y_B1D[:, 0]

    cache, y_CBD = jax.lax.scan(body, cache, (jnp.swapaxes(x_BCD, 0, 1), positions_C,
                                              jnp.swapaxes(seg_BC, 0, 1)))
    return jnp.swapaxes(y_CBD, 0, 1), cache

  def prefill(self, x_BTD: jax.Array, positions_BT: jax.Array, cache: dict,
              segment_ids_BT: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """The parallel pass over a prompt at positions 0..T-1, and the state `step` continues from:
    the open block's keys/values and pooling, the memory of the closed blocks."""
    B, T, D = x_BTD.shape
    L = self.block_size
    closed = T // L
    kv = {name: cache[name] for name in ("k", "v", "pos", "seg")}
    h_BTD, kv = self.attn.prefill(x_BTD, positions_BT, kv, segment_ids_BT)
    cache = dict(cache, **kv)
    if not self.use_memory:
      return h_BTD, cache
    y_BTD = self.fuse(h_BTD, *self.block_memory(h_BTD, segment_ids_BT))
    seg_BT = layers.document_ids(segment_ids_BT, B, T)
    if closed:  # the memory's running sums at the last closed block, restarts included
      seg_BNL = blockwise.split_blocks(seg_BT[:, :closed * L], L)
      s_BND = self.summaries(blockwise.split_blocks(h_BTD[:, :closed * L], L), seg_BNL)
      end_BN = seg_BNL[:, :, -1]
      keep_BN = end_BN == jnp.pad(end_BN, [(0, 0), (1, 0)], constant_values=-1)[:, :-1]
      num_BND, den_BN = memory.memory_sums(s_BND, self.alpha, keep_BN)
      cache.update(num=num_BND[:, -1], den=den_BN[:, -1], mem_seg=end_BN[:, -1])
    if T > closed * L:  # the open block's pooling of its last document so far, as `step` keeps it
      h_BOD = h_BTD[:, closed * L:].astype(jnp.float32)
      seg_BO = seg_BT[:, closed * L:]
      last_B = seg_BO[:, -1]
      logits_BO = jnp.where(seg_BO == last_B[:, None], self.pool_logits(h_BTD[:, closed * L:]),
                            -jnp.inf)
      max_B = logits_BO.max(axis=-1)
      scale_BO = jnp.exp(logits_BO - max_B[:, None])
      cache.update(pool_max=max_B, pool_norm=scale_BO.sum(axis=-1),
                   pool_sum=jnp.einsum("bo,bod->bd", scale_BO, h_BOD), pool_seg=last_B)
    return y_BTD, cache


def _mixer(cfg: ModelConfig, rngs: nnx.Rngs, *, use_memory: bool,
           route: Route) -> Bcmt:
  return Bcmt(cfg.d_model, cfg.num_heads, block_size=cfg.block_size,
              alpha=cfg.alpha, use_memory=use_memory,
              use_rope=cfg.position == "rope", rope_base=cfg.rope_base,
              dtype=layers.dtype_of(cfg.dtype), rngs=rngs, route=route,
              num_kv_heads=cfg.kv_heads)


def make_mixer(cfg: ModelConfig, layer: int, rngs: nnx.Rngs, *,
               route: Route = DEFAULT_ROUTE) -> nnx.Module:
  del layer  # every layer is the same
  return _mixer(cfg, rngs, use_memory=True, route=route)


def make_honly_mixer(cfg: ModelConfig, layer: int, rngs: nnx.Rngs, *,
                     route: Route = DEFAULT_ROUTE) -> nnx.Module:
  del layer
  return _mixer(cfg, rngs, use_memory=False, route=route)


registry.register("bcmt", registry.ModelEntry(make_mixer=make_mixer, logical_axes=LOGICAL_AXES))
registry.register("honly", registry.ModelEntry(make_mixer=make_honly_mixer))
