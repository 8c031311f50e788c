"""Building blocks shared by every model: projections, RoPE, MLP, dropout, decoding caches, and
`SelfAttention`, the one way a mixer reaches attention."""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from efficient_lm.parallel import sharding
from efficient_lm.ops.pattern import Pattern
from efficient_lm.ops.route import Route


def axes(*names: str | None) -> dict:
  """Variable metadata naming each dimension's logical axis (`efficient_lm.parallel.sharding` maps the
  names to mesh axes): e.g. `kernel_metadata=axes("embed", "mlp")`. The names are only metadata
  (no eager sharding at creation): `train_state.build` places every array on the mesh itself."""
  return {"out_sharding": names, "eager_sharding": False}


class RMSNorm(nnx.Module):
  """x / sqrt(mean(x^2) + epsilon) * scale over the last axis: statistics and product in float32,
  the result in the compute dtype (`dtype`), as `nnx.RMSNorm` (the same parameter, `scale`, logical
  axis `norm`, initialized from its own key). With one row (`[1, T, D]`, the long-context batch)
  the scale multiplies the `[T, D]` array without its unit axis: XLA:CPU reduces the scale's
  gradient over `[1, T, D]` 50-100x slower (52 ms against 0.4 ms at T = 8192, D = 256), a tenth of
  a long-context step. Only a unit axis is dropped (a bitcast): merging a batch and a sequence
  axis would cut across their shardings (fsdp x context)."""

  def __init__(self, d_model: int, *, dtype, rngs: nnx.Rngs, epsilon: float = 1e-6):
    self.scale = nnx.Param(nnx.initializers.ones(rngs.params(), (d_model,), jnp.float32),
                           **axes("norm"))
    self.dtype = dtype
    self.epsilon = epsilon

  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = self.dtype or jnp.result_type(x, self.scale[...])
    x32 = x.astype(dtype).astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    scale = self.scale[...].astype(dtype).astype(jnp.float32)
    if y.ndim > 2 and y.shape[0] == 1:
      return (y[0] * scale)[None].astype(dtype)
    return (y * scale).astype(dtype)


def rms_norm(d_model: int, *, dtype, rngs: nnx.Rngs) -> RMSNorm:
  """RMSNorm whose scale is replicated (logical axis `norm`)."""
  return RMSNorm(d_model, dtype=dtype, rngs=rngs)


def dtype_of(name: str) -> jnp.dtype:
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def dropout(x: jax.Array, rate: float, key: jax.Array | None,
            positions_BT: jax.Array | None = None) -> jax.Array:
  """Inverted dropout; the identity when `key` is None (eval) or `rate` is 0. With `positions_BT`
  (x is `[B, T, ...]`) each token's mask is drawn from `key`, its row and its absolute position
  alone, so a sequence run in chunks (`model.seq_chunk`) gets the very masks it gets whole."""
  if key is None or rate == 0.0:
    return x
  if positions_BT is not None:
    B = x.shape[0]
    rows_BT = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], positions_BT.shape)
    token_key = lambda b, p: jax.random.fold_in(jax.random.fold_in(key, b), p)
    keys_BT = jax.vmap(jax.vmap(token_key))(rows_BT, positions_BT.astype(jnp.int32))
    keep = jax.vmap(jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, x.shape[2:])))(keys_BT)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def rope(x_BTHK: jax.Array, positions_BT: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding (rotate-half form) at the given positions."""
  K = x_BTHK.shape[-1]
  inv_freq_F = base ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
  angles_BTF = positions_BT[..., None].astype(jnp.float32) * inv_freq_F
  sin_BT1F = jnp.sin(angles_BTF)[:, :, None, :]
  cos_BT1F = jnp.cos(angles_BTF)[:, :, None, :]
  x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos_BT1F - x2 * sin_BT1F, x2 * cos_BT1F + x1 * sin_BT1F], axis=-1)
  return rotated.astype(x_BTHK.dtype)


# Key/value buffers for decoding: `span` slots, position p in slot p % span, `pos` = -1 when empty,
# `seg` the document id of each slot's token (per batch row). Keys and values are stored
# heads-first and rank 3, `[B * H, span, K]` (N = B * H): XLA on CPU then updates the slot in
# place and the core (layout "BHTK", a free reshape) reads the buffer straight into its matmul
# (with `[B, S, H, K]` it copied the whole cache every step: decoding time grew with the
# cache's size).

def heads_first(x_BCHK: jax.Array) -> jax.Array:
  """`[B, C, H, K]` -> `[B * H, C, K]`, the cache layout."""
  B, C, H, K = x_BCHK.shape
  return jnp.swapaxes(x_BCHK, 1, 2).reshape(B * H, C, K)


def document_ids(segment_ids_BT: jax.Array | None, batch_size: int, length: int) -> jax.Array:
  """`segment_ids_BT` as int32, or one document (zeros) when None."""
  if segment_ids_BT is None:
    return jnp.zeros((batch_size, length), jnp.int32)
  return jnp.asarray(segment_ids_BT, jnp.int32)


def kv_cache_init(batch_size: int, span: int, num_heads: int, head_dim: int, dtype,
                  visible: "Visible | None" = None) -> dict:
  """An empty cache of `span` slots; with `visible` (a window and skips, `visible_slots`) also the
  buffer of the slots a decoding step reads (`kv_cache_step`)."""
  shape = (batch_size * num_heads, span, head_dim)
  cache = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
           "pos": jnp.full((span,), -1, jnp.int32),
           "seg": jnp.full((batch_size, span), -1, jnp.int32)}
  if visible is not None:
    shape = (batch_size * num_heads, visible.size, head_dim)
    cache.update(vis_k=jnp.zeros(shape, dtype), vis_v=jnp.zeros(shape, dtype),
                 vis_pos=jnp.full((visible.size,), -1, jnp.int32),
                 vis_seg=jnp.full((batch_size, visible.size), -1, jnp.int32))
  return cache


def kv_cache_extend(cache: dict, k_BCHK: jax.Array, v_BCHK: jax.Array, pos_C: jax.Array,
                    seg_BC: jax.Array, visible: "Visible | None" = None
                    ) -> tuple[tuple[jax.Array, ...], dict]:
  """((keys `[B * H, S, K]`, values, their positions `[S]`, their document ids `[B, S]`), the new
  cache) for C new tokens.

  One token (decoding) is written into its slot first and attends over the
  cache in place: the slot it overwrites (position - span) is out of every
  pattern's reach; with `visible` it attends over the visible-slot buffer
  instead (`kv_cache_step`). A chunk attends over the old cache (the ring)
  followed by itself, then is written.
  """
  new_cache = kv_cache_write(cache, k_BCHK, v_BCHK, pos_C, seg_BC, visible)
  if k_BCHK.shape[1] == 1:
    if visible is not None:
      new_cache = kv_cache_step(new_cache, k_BCHK, v_BCHK, pos_C[0], seg_BC, visible)
      return tuple(new_cache[f"vis_{name}"] for name in ("k", "v", "pos", "seg")), new_cache
    return (new_cache["k"], new_cache["v"], new_cache["pos"], new_cache["seg"]), new_cache
  as_cached = lambda x_BCHK, a: heads_first(x_BCHK).astype(a.dtype)
  return ((jnp.concatenate([cache["k"], as_cached(k_BCHK, cache["k"])], axis=1),
           jnp.concatenate([cache["v"], as_cached(v_BCHK, cache["v"])], axis=1),
           jnp.concatenate([cache["pos"], pos_C]),
           jnp.concatenate([cache["seg"], seg_BC], axis=1)), new_cache)


def _put(a: jax.Array, x: jax.Array, slot, axis: int) -> jax.Array:
  """`a` with `x` (cast to `a`'s dtype) written at `slot` along `axis`: an in-place slice update."""
  return jax.lax.dynamic_update_slice_in_dim(a, x.astype(a.dtype), slot, axis)


def kv_cache_write(cache: dict, k_BCHK: jax.Array, v_BCHK: jax.Array, pos_C: jax.Array,
                   seg_BC: jax.Array, visible: "Visible | None" = None) -> dict:
  """The cache after storing the chunk (only its last `span` tokens when the chunk is longer).
  With `visible` (the cache has a visible-slot buffer) a chunk refills the buffer's window
  slots; a decoding step's are kept by `kv_cache_step`."""
  span = cache["pos"].shape[0]
  k_NCK, v_NCK = heads_first(k_BCHK), heads_first(v_BCHK)
  if k_NCK.shape[1] == 1:  # a decoding step: an in-place slice update
    slot = pos_C[0] % span
    return dict(cache, k=_put(cache["k"], k_NCK, slot, 1), v=_put(cache["v"], v_NCK, slot, 1),
                pos=_put(cache["pos"], pos_C, slot, 0), seg=_put(cache["seg"], seg_BC, slot, 1))
  last = pos_C[-1]
  if k_NCK.shape[1] > span:
    k_NCK, v_NCK, pos_C, seg_BC = k_NCK[:, -span:], v_NCK[:, -span:], pos_C[-span:], seg_BC[:, -span:]
  slots_C = pos_C % span
  cache = dict(cache, k=cache["k"].at[:, slots_C].set(k_NCK.astype(cache["k"].dtype)),
               v=cache["v"].at[:, slots_C].set(v_NCK.astype(cache["v"].dtype)),
               pos=cache["pos"].at[slots_C].set(pos_C),
               seg=cache["seg"].at[:, slots_C].set(seg_BC.astype(jnp.int32)))
  return cache if visible is None else _refill_window(cache, last, visible.window)


# The visible-slot buffer (π's decoding): a query at p sees at most its window's `window` keys and
# one key per skip, fewer than the ring's `span` slots (131 of 385 at window 128, period 128, 3
# skips), and XLA:CPU reads a buffer in a dot (or a gather) at about one element a cycle, so a
# decoding step that scored the whole ring (or gathered the visible slots out of it) spent most of
# a batch's attention time on slots it cannot see. The cache therefore keeps, next to the ring,
# the `window + len(skips)` slots the next query reads: slots 0..window-1 a ring of the last
# `window` tokens (position p in slot p % window), then one slot per skip, refilled from the ring
# at every step. The core reads that buffer whole, with its slots' positions and document ids.

@dataclasses.dataclass(frozen=True)
class Visible:
  """The visible-slot buffer's shape: `window` ring slots, then one slot per skip distance."""
  window: int
  skips: tuple[int, ...]

  @property
  def size(self) -> int:
    return self.window + len(self.skips)


def visible_slots(pattern: Pattern, span: int) -> Visible | None:
  """The keys a decoding query of `pattern` can see in a ring of `span` slots, when a
  visible-slot buffer is smaller than the ring; None otherwise (no window, blocks, a
  bidirectional pattern, or a window that fills the ring: the step reads the ring itself).
  Skips at or past `span` never land on a cached key and are left out."""
  if pattern.window is None or pattern.block_size is not None or not pattern.causal:
    return None
  visible = Visible(pattern.window, pattern.skip_offsets(span))
  return visible if visible.size < span else None


def _refill_window(cache: dict, last: jax.Array, window: int) -> dict:
  """The visible buffer's window slots refilled from the ring after a chunk whose last token is
  at `last`: window slot w holds the latest position p <= last with p % window = w (-1 when the
  ring does not hold it: before the sequence start)."""
  span = cache["pos"].shape[0]
  w_W = jnp.arange(window, dtype=jnp.int32)
  p_W = last - (last - w_W) % window
  slots_W = p_W % span
  pos_W = jnp.where(cache["pos"][slots_W] == p_W, p_W, -1)
  return dict(cache, vis_k=_put(cache["vis_k"], cache["k"][:, slots_W], 0, 1),
              vis_v=_put(cache["vis_v"], cache["v"][:, slots_W], 0, 1),
              vis_pos=_put(cache["vis_pos"], pos_W, 0, 0),
              vis_seg=_put(cache["vis_seg"], cache["seg"][:, slots_W], 0, 1))


def kv_cache_step(cache: dict, k_B1HK: jax.Array, v_B1HK: jax.Array, position: jax.Array,
                  seg_B1: jax.Array, visible: Visible) -> dict:
  """The visible-slot buffer for the query at `position`, whose token the ring already holds: the
  token into window slot position % window (in place), and each skip's key (position - d) copied
  from the ring into the skip slots. O(B H (1 + skips) K) a step."""
  span = cache["pos"].shape[0]
  put = lambda name, x, slot, axis: _put(cache[name], x, slot, axis)  # the current `cache`
  slot = position % visible.window
  cache = dict(cache, vis_k=put("vis_k", heads_first(k_B1HK), slot, 1),
               vis_v=put("vis_v", heads_first(v_B1HK), slot, 1),
               vis_pos=put("vis_pos", position[None], slot, 0),
               vis_seg=put("vis_seg", seg_B1, slot, 1))
  if not visible.skips:
    return cache
  sources = [(position - d) % span for d in visible.skips]
  take = lambda name, axis: jnp.concatenate(
      [jax.lax.dynamic_slice_in_dim(cache[name], a, 1, axis) for a in sources], axis=axis)
  return dict(cache, vis_k=put("vis_k", take("k", 1), visible.window, 1),
              vis_v=put("vis_v", take("v", 1), visible.window, 1),
              vis_pos=put("vis_pos", take("pos", 0), visible.window, 0),
              vis_seg=put("vis_seg", take("seg", 1), visible.window, 1))


def chunk_positions(start: jax.Array, batch_size: int, length: int) -> tuple[jax.Array, jax.Array]:
  """Positions start..start+length-1: `[length]` and broadcast to `[B, length]`."""
  pos_C = jnp.asarray(start, jnp.int32) + jnp.arange(length, dtype=jnp.int32)
  return pos_C, jnp.broadcast_to(pos_C, (batch_size, length))


class Mlp(nnx.Module):
  """D -> F -> D with GELU, F = mlp_ratio * D."""

  def __init__(self, d_model: int, mlp_ratio: int, *, dtype, rngs: nnx.Rngs):
    hidden = mlp_ratio * d_model
    self.up = nnx.Linear(d_model, hidden, dtype=dtype, rngs=rngs,
                         kernel_metadata=axes("embed", "mlp"), bias_metadata=axes("mlp"))
    self.down = nnx.Linear(hidden, d_model, dtype=dtype, rngs=rngs,
                           kernel_metadata=axes("mlp", "embed"), bias_metadata=axes("embed"))

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    h_BTF = sharding.constrain(self.up(x_BTD), "batch", "length", "mlp")
    return self.down(jax.nn.gelu(h_BTF))


class SelfAttention(nnx.Module):
  """q, k, v projections, RoPE (optional), attention over `pattern`, output projection.

  The pattern is stated once, here; every attention runs through `route.attend`
  (`ops.route`: the backend, and the ring when the sequence is sharded), in
  every mode: the whole sequence (`__call__`), a sequence chunk
  (`attend_chunk`, `models/chunking.py`), and cached decoding (`init_cache`,
  `prefill`, `extend`). `local_prior` / `skip_prior` (`[B, T, H]`, π's
  log-gates) join the local and skip logits; `segment_ids` (`[B, T]`,
  document ids) keep every query inside its own document.

  Grouped-query attention (`num_kv_heads` < `num_heads`, dividing it): keys and values have
  `num_kv_heads` heads (`[B, T, H_kv, K]`), each serving num_heads / num_kv_heads query heads
  (the core groups the queries: `ops.core.heads`), from their own `[D, 2, H_kv, K]` projection
  `kv` beside the queries' `[D, H, K]` `q` (logical axis `kv_heads` for theirs); the decoding
  cache holds `num_kv_heads` heads. With as many as the queries (the default) q, k and v stay
  one `[D, 3, H, K]` projection, `qkv`, as before grouped heads.
  """

  def __init__(self, d_model: int, num_heads: int, pattern: Pattern, *, route: Route,
               use_rope: bool, rope_base: float, dtype, rngs: nnx.Rngs,
               num_kv_heads: int | None = None):
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads or num_heads
    self.pattern = pattern
    self.route = route
    self.use_rope = use_rope
    self.rope_base = rope_base
    K = d_model // num_heads
    linear = lambda shape, *names: nnx.LinearGeneral(
        d_model, shape, use_bias=False, dtype=dtype, rngs=rngs, kernel_metadata=axes(*names))
    if self.grouped:
      self.q = linear((num_heads, K), "embed", "heads", "kv")
      self.kv = linear((2, self.num_kv_heads, K), "embed", "qkv", "kv_heads", "kv")
    else:  # q, k, v as one [D, 3, H, K] projection: heads stay whole when `heads` is sharded.
      self.qkv = linear((3, num_heads, K), "embed", "qkv", "heads", "kv")
    self.out = nnx.Linear(d_model, d_model, use_bias=False, dtype=dtype, rngs=rngs,
                          kernel_metadata=axes("heads", "embed"))  # input dim H*K, heads-major

  @property
  def grouped(self) -> bool:
    """Fewer key/value heads than query heads (grouped-query attention)."""
    return self.num_kv_heads != self.num_heads

  @property
  def patterns(self) -> tuple[Pattern, ...]:
    """The patterns this module attends with (what the registry checks the backend against)."""
    return (self.pattern,)

  def project(self, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, ...]:
    """(q `[B, T, H, K]`, k and v `[B, T, H_kv, K]`), RoPE applied."""
    if self.grouped:
      q_BTHK = sharding.constrain(self.q(x_BTD), "batch", "length", "heads", "kv")
      kv_BT2GK = sharding.constrain(self.kv(x_BTD), "batch", "length", None, "kv_heads", "kv")
      k_BTHK, v_BTHK = kv_BT2GK[:, :, 0], kv_BT2GK[:, :, 1]
    else:
      qkv_BT3HK = sharding.constrain(self.qkv(x_BTD), "batch", "length", None, "heads", "kv")
      q_BTHK, k_BTHK, v_BTHK = (qkv_BT3HK[:, :, i] for i in range(3))
    if self.use_rope:
      q_BTHK = rope(q_BTHK, positions_BT, self.rope_base)
      k_BTHK = rope(k_BTHK, positions_BT, self.rope_base)
    return q_BTHK, k_BTHK, v_BTHK

  def output(self, o_BTHK: jax.Array) -> jax.Array:
    """The output projection of attention outputs `[B, T, H, K]`."""
    B, T, H, K = o_BTHK.shape
    return self.out(o_BTHK.reshape(B, T, H * K))

  def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array,
               segment_ids_BT: jax.Array | None = None, **priors) -> jax.Array:
    q_BTHK, k_BTHK, v_BTHK = self.project(x_BTD, positions_BT)
    return self.output(self.route.attend(q_BTHK, k_BTHK, v_BTHK, self.pattern,
                                         segment_ids=segment_ids_BT, **priors))

  # The same projections one part at a time (sequence-chunked blocks, `models/chunking.py`):
  # the keys and values of the whole sequence, the queries of a chunk.

  def _heads(self, x_BTD: jax.Array, part: slice) -> jax.Array:
    """The projection's outputs `part` (of q, k, v; of k, v with grouped heads) only:
    `[B, T, parts, H, K]`."""
    module, heads = (self.kv, "kv_heads") if self.grouped else (self.qkv, "heads")
    kernel_DnHK = module.kernel[...][:, part].astype(module.dtype or x_BTD.dtype)
    x_BTnHK = jnp.einsum("btd,dnhk->btnhk", x_BTD.astype(kernel_DnHK.dtype), kernel_DnHK)
    return sharding.constrain(x_BTnHK, "batch", "length", None, heads, "kv")

  def queries(self, x_BTD: jax.Array, positions_BT: jax.Array) -> jax.Array:
    if self.grouped:
      q_BTHK = sharding.constrain(self.q(x_BTD), "batch", "length", "heads", "kv")
    else:
      q_BTHK = self._heads(x_BTD, slice(0, 1))[:, :, 0]
    return rope(q_BTHK, positions_BT, self.rope_base) if self.use_rope else q_BTHK

  def keys_values(self, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    kv_BT2HK = self._heads(x_BTD, slice(0, 2) if self.grouped else slice(1, 3))
    k_BTHK, v_BTHK = kv_BT2HK[:, :, 0], kv_BT2HK[:, :, 1]
    return (rope(k_BTHK, positions_BT, self.rope_base) if self.use_rope else k_BTHK), v_BTHK

  def attend_chunk(self, x_BCD, positions_BC, k_BWHK, v_BWHK, q_start, k_offset: int,
                   q_align: int, segment_ids=None, **priors) -> jax.Array:
    """The output `[B, C, D]` of a chunk of queries (at the traced `q_start`, a multiple of
    `q_align`) attending over its key window, which starts `k_offset` (static) before;
    `segment_ids` = (the chunk's document ids `[B, C]`, the window's `[B, W]`) or None."""
    q_ids, k_ids = segment_ids if segment_ids is not None else (None, None)
    o_BCHK = self.route.attend(self.queries(x_BCD, positions_BC), k_BWHK, v_BWHK, self.pattern,
                               q_start=q_start, k_offset=k_offset, q_align=q_align,
                               segment_ids=q_ids, k_segment_ids=k_ids, **priors)
    return self.output(o_BCHK)

  # Cached decoding: a ring buffer of the keys any later token can still see.

  def init_cache(self, batch_size: int, max_len: int) -> dict:
    """`[B * H_kv, span, K]` keys and values (and their slots' positions and documents)."""
    D = self.out.in_features
    span = self.pattern.span(max_len)
    dtype = (self.kv if self.grouped else self.qkv).dtype or jnp.float32
    return kv_cache_init(batch_size, span, self.num_kv_heads, D // self.num_heads, dtype,
                         visible_slots(self.pattern, span))

  def _visible(self, cache: dict) -> Visible | None:
    """The cache's visible-slot buffer (`visible_slots`), or None when it has none."""
    return visible_slots(self.pattern, cache["pos"].shape[0]) if "vis_k" in cache else None

  def prefill(self, x_BTD: jax.Array, positions_BT: jax.Array, cache: dict,
              segment_ids_BT: jax.Array | None = None, **priors) -> tuple[jax.Array, dict]:
    """The ordinary pass over a prompt from an empty cache; the cache keeps its last keys/values."""
    B, T, _ = x_BTD.shape
    q_BTHK, k_BTHK, v_BTHK = self.project(x_BTD, positions_BT)
    y_BTD = self.output(self.route.attend(q_BTHK, k_BTHK, v_BTHK, self.pattern,
                                          segment_ids=segment_ids_BT, **priors))
    seg_BT = document_ids(segment_ids_BT, B, T)
    return y_BTD, kv_cache_write(cache, k_BTHK, v_BTHK, positions_BT[0], seg_BT,
                                 self._visible(cache))

  def extend(self, x_BCD: jax.Array, start: jax.Array, cache: dict,
             segment_ids_BC: jax.Array | None = None, **priors) -> tuple[jax.Array, dict]:
    """C tokens at positions start.. against the cached keys and each other."""
    B, C, _ = x_BCD.shape
    pos_C, positions_BC = chunk_positions(start, B, C)
    q_BCHK, k_BCHK, v_BCHK = self.project(x_BCD, positions_BC)
    seg_BC = document_ids(segment_ids_BC, B, C)
    (k_NSK, v_NSK, pos_S, seg_BS), cache = kv_cache_extend(cache, k_BCHK, v_BCHK, pos_C, seg_BC,
                                                           self._visible(cache))
    return self.output(self.cached(q_BCHK, k_NSK, v_NSK, pos_S, pos_C[0], seg_BC, seg_BS,
                                   **priors)), cache

  def cached(self, q_BCHK: jax.Array, k_NSK: jax.Array, v_NSK: jax.Array, pos_S: jax.Array,
             start: jax.Array, seg_BC: jax.Array, seg_BS: jax.Array, *, pattern=None,
             local_prior=None, skip_prior=None) -> jax.Array:
    """C queries at positions start.. over cached keys / values `[B * H_kv, S, K]` at slot
    positions `pos_S` (-1 = empty) and documents `seg_BS`: the route in the cache's layout,
    `[B, C, H, K]`."""
    B, C, H, K = q_BCHK.shape
    N = k_NSK.shape[0]  # B * H_kv: a key/value head's G = H / H_kv query heads share its row
    # Heads folded into the batch (N rows of one key/value head each), so the cache is read in
    # its own layout: read as [B, H, S, K], XLA copied the whole cache twice a decoding step
    # when B > 1.
    fold = lambda x_BHX: x_BHX.reshape(N, H * B // N, *x_BHX.shape[2:])
    rows = lambda ids_BX: None if ids_BX is None else jnp.repeat(ids_BX, N // B, axis=0)
    prior = lambda p_BCH: None if p_BCH is None else fold(jnp.swapaxes(p_BCH, 1, 2))
    o_N1CK = self.route.attend(fold(jnp.swapaxes(q_BCHK, 1, 2)), k_NSK[:, None], v_NSK[:, None],
                               pattern or self.pattern, q_start=start, k_positions=pos_S,
                               local_prior=prior(local_prior), skip_prior=prior(skip_prior),
                               segment_ids=rows(seg_BC), k_segment_ids=rows(seg_BS), layout="BHTK")
    return jnp.swapaxes(o_N1CK.reshape(B, H, C, K), 1, 2)
