"""The Perceiver-AR family: PerceiverAR and the three double-attention variants (`VARIANTS`).

Every layer works on a stream `[history; latents]`, the latents the last Z = `num_latents`
positions, whose queries cross-attend causally to the whole stream (`Pattern.dense()` at the
stream's end).
The history is dropped after layer 1 (`perceiver_ar`), or refined in every layer by its own
bidirectional self-attention (`double_attention`), first compressed along the sequence
(`compressed_double_attention`, `model.compression_op`), or inside `num_history_segments`
segments (`ssplit_double_attention`). Logits `[B, Z, V]`, latents only. Decoding (`init_cache`,
`prefill`, `extend`) fixes the history at prefill and makes every new token a latent: its logits
equal one full pass over the sequence with that history. With documents (`segment_ids_BT`) a
latent and a history token see only their own document's keys; a compressed slot pools only
the tokens of its group's last document.
Details: docs/architecture.md, "The Perceiver-AR family and ECP" and "Generation".
"""

import jax
import jax.numpy as jnp
from flax import nnx

from efficient_lm.config import axes
from efficient_lm.config.model import ModelConfig
from efficient_lm.families.perceiver_ar import VARIANTS
from efficient_lm.models import decoder
from efficient_lm.models import layers
from efficient_lm.models import registry
from efficient_lm.ops import precision
from efficient_lm.ops.pattern import Pattern
from efficient_lm.ops.route import Route
from efficient_lm.config.errors import require_positive_int


LOGICAL_AXES = axes.FAMILY_AXES["perceiver_ar"]  # (declared without jax: efficient_lm/config/axes.py)


def mean_pool_matrix(history: int, compression: int) -> jax.Array:
  """`[history, history / compression]`: slot c is the mean of history tokens c*comp .. (c+1)*comp - 1."""
  h = jnp.arange(history)[:, None]
  c = jnp.arange(history // compression)[None, :]
  return jnp.where(h // compression == c, 1.0 / compression, 0.0).astype(jnp.float32)


class PerceiverBlock(nnx.Module):
  """One layer over `x_BSD` = [history; latents] (history may be empty); returns what is kept
  and the layer's keys/values (the cache of decoding).

  Latent queries: causal attention over the whole stream at the stream's end. History
  queries (if `refine_history`): bidirectional attention inside `history_segments` segments of
  the history (`Pattern.segments`). Without
  `refine_history` the history is dropped after serving as keys/values. Then
  the MLP on the kept stream. Pre-norm residual branches with dropout, as the
  shared decoder's Block. The number of latents is an argument (not a setting
  of the layer): a prompt shorter than `model.num_latents` is all latents.
  """

  def __init__(self, cfg: ModelConfig, *, refine_history: bool,
               history_segments: int, history: int, route: Route, rngs: nnx.Rngs):
    dtype = layers.dtype_of(cfg.dtype)
    self.route = route
    self.refine_history = refine_history
    self.history_segments = history_segments
    self.dropout_rate = cfg.dropout
    self.mixer_norm = layers.rms_norm(cfg.d_model, dtype=dtype, rngs=rngs)
    # The latents' causal attention over the stream (their cache in decoding too).
    self.attn = layers.SelfAttention(cfg.d_model, cfg.num_heads, Pattern.dense(), route=route,
                                     use_rope=cfg.position == "rope", rope_base=cfg.rope_base,
                                     dtype=dtype, rngs=rngs, num_kv_heads=cfg.kv_heads)
    # The patterns it trains with: the latents', and the history's segments at `history` (the
    # stream's history length in training; a shorter prompt's history is cut the same way).
    self.patterns = (Pattern.dense(),)
    if refine_history and history > 0:
      self.patterns += (self.history_pattern(history),)
    self.mlp_norm = layers.rms_norm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.mlp = layers.Mlp(cfg.d_model, cfg.mlp_ratio, dtype=dtype, rngs=rngs)

  def history_pattern(self, history: int) -> Pattern:
    """Bidirectional inside each of the `history_segments` segments of a history."""
    return Pattern.segments(max(1, history // self.history_segments))

  def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, seg_BS: jax.Array | None,
               key: jax.Array | None, num_latents: int
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    B, S, D = x_BSD.shape
    history = S - num_latents
    mixer_key = mlp_key = None
    if key is not None:
      mixer_key, mlp_key = jax.random.split(key)
    q_BSHK, k_BSHK, v_BSHK = self.attn.project(self.mixer_norm(x_BSD), positions_BS)
    latent_ids = {} if seg_BS is None else dict(segment_ids=seg_BS[:, history:],
                                                k_segment_ids=seg_BS)
    o_BZHK = self.route.attend(q_BSHK[:, history:], k_BSHK, v_BSHK, self.attn.pattern,
                               q_start=history, **latent_ids)
    if self.refine_history:
      history_ids = {} if seg_BS is None else dict(segment_ids=seg_BS[:, :history])
      o_BHHK = self.route.attend(q_BSHK[:, :history], k_BSHK[:, :history], v_BSHK[:, :history],
                                 self.history_pattern(history), **history_ids)
      o_BSHK = jnp.concatenate([o_BHHK, o_BZHK], axis=1)
    else:
      o_BSHK, x_BSD = o_BZHK, x_BSD[:, history:]
    x_BSD = x_BSD + layers.dropout(self.attn.out(o_BSHK.reshape(B, x_BSD.shape[1], D)),
                                   self.dropout_rate, mixer_key)
    x_BSD = x_BSD + layers.dropout(self.mlp(self.mlp_norm(x_BSD)), self.dropout_rate, mlp_key)
    return x_BSD, (k_BSHK, v_BSHK)

  def extend(self, x_BCD: jax.Array, positions_BC: jax.Array, cache: dict, first_slot: jax.Array,
             lowest_slot: jax.Array, seg_BC: jax.Array, seg_BS: jax.Array
             ) -> tuple[jax.Array, dict]:
    """C new latents (no dropout): their keys/values enter the layer's cache at slots
    first_slot.., and latent i attends to the cached slots lowest_slot..first_slot + i of its
    own document (the new latents' ids `seg_BC`, every slot's `seg_BS`)."""
    q_BCHK, k_BCHK, v_BCHK = self.attn.project(self.mixer_norm(x_BCD), positions_BC)
    put = lambda buffer, x_BCHK: jax.lax.dynamic_update_slice_in_dim(
        buffer, layers.heads_first(x_BCHK).astype(buffer.dtype), first_slot, axis=1)
    k_NSK, v_NSK = put(cache["k"], k_BCHK), put(cache["v"], v_BCHK)
    slot_S = jnp.arange(k_NSK.shape[1], dtype=jnp.int32)
    slot_S = jnp.where(slot_S >= lowest_slot, slot_S, -1)  # slots below lowest_slot: not seen
    o_BCHK = self.attn.cached(q_BCHK, k_NSK, v_NSK, slot_S, first_slot, seg_BC, seg_BS)
    x_BCD = x_BCD + self.attn.output(o_BCHK)
    x_BCD = x_BCD + self.mlp(self.mlp_norm(x_BCD))
    return x_BCD, {"k": k_NSK, "v": v_NSK}


class PerceiverAR(decoder.LanguageModel):
  """Embedding -> (compression) -> layer 1 -> scanned layers 2.. -> norm -> logits of the latents."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, route: Route):
    super().__init__(cfg, rngs)
    variant = VARIANTS[cfg.name]
    self.variant = cfg.name
    self.seq_len = cfg.seq_len
    self.prompt_window = cfg.seq_len  # generation: prompts right-aligned in the training window
    self.num_latents = cfg.num_latents
    self.refine_history = variant.refine_history
    self.num_heads = cfg.num_heads
    self.num_kv_heads = cfg.kv_heads
    self.dtype = layers.dtype_of(cfg.dtype)
    history = cfg.seq_len - cfg.num_latents
    self.compression = cfg.compression if variant.compress else 1
    self.history = history
    self.compression_op = cfg.compression_op
    self.compress = nnx.data(None)
    if variant.compress and history > 0:  # initialized to mean pooling of consecutive tokens
      if self.compression_op == "learned":
        self.compress = nnx.Param(mean_pool_matrix(history, self.compression),
                                  **layers.axes("history", "compressed"))
      else:
        self.compress = nnx.Param(jnp.full((self.compression, cfg.d_model), 1.0 / self.compression),
                                  **layers.axes("group", "embed"))
    segments = cfg.num_history_segments if variant.split_history else 1
    self.history_segments = segments

    def make_block(rngs: nnx.Rngs) -> PerceiverBlock:
      return PerceiverBlock(cfg, refine_history=variant.refine_history, history_segments=segments,
                            history=history // self.compression, route=route, rngs=rngs)

    self.first = make_block(rngs)
    self.rest = nnx.data(None)
    if cfg.num_layers > 1:  # identical layers: stacked and applied with nnx.scan
      self.rest = decoder.stacked(make_block, cfg.num_layers - 1, rngs)

  def apply_layers(self, x_BTD: jax.Array, *, positions_BT: jax.Array | None = None,
                   segment_ids_BT: jax.Array | None = None,
                   dropout_key: jax.Array | None = None) -> jax.Array:
    """Embeddings `[B, T, D]` -> the latent positions' outputs `[B, Z, D]`."""
    T, Z = x_BTD.shape[1], self.num_latents
    if T < Z:
      raise ValueError(f"sequence length {T} is shorter than model.num_latents={Z}")
    x_BZD, _, _ = self.run_layers(x_BTD, positions_BT, segment_ids_BT, dropout_key, Z,
                                  keep_cache=False)
    return x_BZD

  def compress_history(self, x_BSD, positions_BT, seg_BT, Z: int):
    """The stream with its history compressed: (x, positions, document ids or None). A slot
    takes the position and the document of the last token of the group it was initialized to
    pool, and pools only that document's tokens."""
    B, T = x_BSD.shape[:2]
    history, c = T - Z, self.compression
    if history != self.history:
      raise ValueError(f"the compressed model was built for a history of {self.history} "
                       f"tokens (model.seq_len - model.num_latents), got {history}")
    history_BHD = x_BSD[:, :history].astype(self.dtype)
    weights = self.compress[...].astype(self.dtype)
    slot_seg_BC = None if seg_BT is None else seg_BT[:, c - 1:history:c]
    if self.compression_op == "learned":
      if slot_seg_BC is None:
        compressed_BCD = precision.einsum_f32("bhd,hc->bcd", history_BHD, weights)
      else:  # the map masked per row: O(history * slots), as the map itself
        same_BHC = seg_BT[:, :history, None] == slot_seg_BC[:, None, :]
        compressed_BCD = precision.einsum_f32(
            "bhd,bhc->bcd", history_BHD, jnp.where(same_BHC, weights[None], 0).astype(self.dtype))
    else:  # each group of c consecutive tokens, weighted per position and channel
      groups_BNcD = history_BHD.reshape(B, history // c, c, history_BHD.shape[-1])
      if slot_seg_BC is not None:
        same_BNc = seg_BT[:, :history].reshape(B, history // c, c) == slot_seg_BC[..., None]
        groups_BNcD = jnp.where(same_BNc[..., None], groups_BNcD, 0).astype(groups_BNcD.dtype)
      compressed_BCD = precision.einsum_f32("bncd,cd->bnd", groups_BNcD, weights)
    x_BSD = jnp.concatenate([compressed_BCD, x_BSD[:, history:]], axis=1)
    positions_BS = jnp.concatenate([positions_BT[:, c - 1:history:c], positions_BT[:, history:]],
                                   axis=1)
    seg_BS = None if seg_BT is None else jnp.concatenate([slot_seg_BC, seg_BT[:, history:]], axis=1)
    return x_BSD, positions_BS, seg_BS

  def run_layers(self, x_BTD: jax.Array, positions_BT: jax.Array | None,
                 segment_ids_BT: jax.Array | None, dropout_key: jax.Array | None,
                 num_latents: int, *, keep_cache: bool):
    """(the last `num_latents` positions' outputs `[B, Z, D]`, every layer's keys/values or None,
    the stream's document ids `[B, S]` or None).

    Keys/values are `(k, v)` pairs over the layer's stream: `[B, S, H, K]` for layer 1 and
    `[num_layers - 1, B, S', H, K]` for the scanned rest (S' = Z for perceiver_ar).
    """
    Z = num_latents
    x_BSD, positions_BT, layer_keys = self.prepare_input(x_BTD, positions_BT, dropout_key)
    seg_BS = None if segment_ids_BT is None else jnp.asarray(segment_ids_BT, jnp.int32)
    positions_BS = positions_BT
    if self.compress is not None:
      x_BSD, positions_BS, seg_BS = self.compress_history(x_BSD, positions_BT, seg_BS, Z)
    stream_seg_BS = seg_BS

    x_BSD, first_kv = self.first(x_BSD, positions_BS, seg_BS, layer_keys[0], Z)
    if not self.refine_history:
      positions_BS = positions_BS[:, -Z:]
      seg_BS = None if seg_BS is None else seg_BS[:, -Z:]
    rest_kv = None
    if self.rest is not None:
      keys = None if layer_keys[0] is None else layer_keys[1:]

      @nnx.scan(in_axes=(nnx.Carry, 0, None, None, 0 if keys is not None else None),
                out_axes=(nnx.Carry, 0), transform_metadata=decoder.LAYERS_AXIS)
      def apply_blocks(x_BSD, block, positions_BS, seg_BS, key):
        x_BSD, kv = block(x_BSD, positions_BS, seg_BS, key, Z)
        return x_BSD, (kv if keep_cache else None)

      x_BSD, rest_kv = apply_blocks(x_BSD, self.rest, positions_BS, seg_BS, keys)

    return x_BSD[:, -Z:], ((first_kv, rest_kv) if keep_cache else None), stream_seg_BS

  # Cached decoding (docs/architecture.md, "Generation").

  def _slot_shift(self) -> int:
    """Absolute position minus stream slot of a latent: the history tokens compression removed."""
    if self.compress is None:
      return 0
    return self.history - self.history // self.compression

  def init_cache(self, batch_size: int, max_len: int) -> dict:
    """Zeroed key/value buffers, one slot per stream position (compressed history + latents)."""
    require_positive_int("max_len", max_len)
    if self.pos_embed is not None and max_len > self.seq_len:
      raise ValueError(f"max_len={max_len} exceeds model.seq_len={self.seq_len}, the number of "
                       f"learned position embeddings; decode at most {self.seq_len} tokens")
    if self.compress is not None and max_len < self.seq_len:
      raise ValueError(f"max_len={max_len} is below model.seq_len={self.seq_len}: {self.variant} "
                       f"prefills exactly seq_len tokens; set max_len >= {self.seq_len}")
    D = self.embed.features
    # The decoder's cache layout, [B * H_kv, slots, K], one buffer per layer: updated in place.
    shape = (batch_size * self.num_kv_heads, max_len - self._slot_shift(), D // self.num_heads)
    kv = lambda: {"k": jnp.zeros(shape, self.dtype), "v": jnp.zeros(shape, self.dtype)}
    cache = {"history": jnp.zeros((), jnp.int32), "first": kv(),
             "seg": jnp.full((batch_size, shape[1]), -1, jnp.int32)}  # each slot's document
    if self.rest is not None:
      cache["rest"] = [kv() for _ in range(self.num_layers - 1)]
    return cache

  def _max_len(self, cache: dict) -> int:
    return cache["first"]["k"].shape[1] + self._slot_shift()

  def prefill(self, tokens_BT: jax.Array, cache: dict, segment_ids_BT: jax.Array | None = None, *,
              last_only: bool = False) -> tuple[jax.Array, dict]:
    """(`model(tokens_BT)`: logits `[B, min(Z, T), V]`, the cache) from a fresh cache; the prompt's
    history, h = T - min(Z, T) tokens, is fixed from now on."""
    T = tokens_BT.shape[1]
    max_len, Z = self._max_len(cache), self.num_latents
    if not 1 <= T <= max_len:
      raise ValueError(f"a prompt of {T} tokens does not fit the cache: it holds 1..max_len="
                       f"{max_len} tokens; init_cache with a larger max_len or a shorter prompt")
    latents = min(Z, T)
    history = T - latents
    if self.compress is not None and history != self.history:
      raise ValueError(f"{self.variant} prefills exactly model.seq_len={self.seq_len} tokens (its "
                       f"compression is tied to a history of {self.history}), got {T}: "
                       f"left-pad the prompt with the end-of-document id (or keep its last "
                       f"{self.seq_len} tokens)")
    if history % self.history_segments:
      raise ValueError(f"a prompt of {T} tokens leaves a history of {history}, not a multiple of "
                       f"model.num_history_segments={self.history_segments}; left-pad the prompt "
                       f"with {self.history_segments - history % self.history_segments} "
                       f"end-of-document tokens")
    B = tokens_BT.shape[0]
    seg_BT = layers.document_ids(segment_ids_BT, B, T)
    x_BZD, (first_kv, rest_kv), seg_BS = self.run_layers(
        self.embed_tokens(tokens_BT), None, seg_BT, None, latents, keep_cache=True)
    put = lambda buffer, kv_BSHK, at: buffer.at[:, at:at + kv_BSHK.shape[1]].set(
        layers.heads_first(kv_BSHK).astype(buffer.dtype))
    cache = dict(cache, history=jnp.asarray(history, jnp.int32),
                 seg=cache["seg"].at[:, :seg_BS.shape[1]].set(seg_BS))
    cache["first"] = {"k": put(cache["first"]["k"], first_kv[0], 0),
                      "v": put(cache["first"]["v"], first_kv[1], 0)}
    if rest_kv is not None:
      at = 0 if self.refine_history else history  # perceiver_ar: later layers hold latents only
      cache["rest"] = [{"k": put(layer["k"], rest_kv[0][i], at),
                        "v": put(layer["v"], rest_kv[1][i], at)}
                       for i, layer in enumerate(cache["rest"])]
    return self.head_logits(x_BZD, last_only), cache

  def extend(self, tokens_BC: jax.Array, cache: dict, start: jax.Array,
             segment_ids_BC: jax.Array | None = None, *, last_only: bool = False
             ) -> tuple[jax.Array, dict]:
    """Logits `[B, C, V]` for C new latents at positions start.. (after the prefilled prompt)."""
    B, C = tokens_BC.shape
    max_len = self._max_len(cache)
    try:  # checked when known before tracing; a traced start must keep start + C <= max_len
      known_start = int(start)
    except (jax.errors.ConcretizationTypeError, TypeError):
      known_start = None
    if C > max_len or (known_start is not None and not 0 <= known_start <= max_len - C):
      raise ValueError(f"{C} tokens at position {known_start} do not fit the cache of max_len="
                       f"{max_len} tokens; init_cache with a larger max_len")
    start = jnp.asarray(start, jnp.int32)
    _, positions_BC = layers.chunk_positions(start, B, C)
    x_BCD, _, _ = self.prepare_input(self.embed_tokens(tokens_BC), positions_BC, None)
    first_slot = start - self._slot_shift()
    zero = jnp.zeros((), jnp.int32)
    seg_BC = layers.document_ids(segment_ids_BC, B, C)
    seg_BS = jax.lax.dynamic_update_slice_in_dim(cache["seg"], seg_BC, first_slot, axis=1)
    x_BCD, first_cache = self.first.extend(x_BCD, positions_BC, cache["first"], first_slot, zero,
                                           seg_BC, seg_BS)
    cache = dict(cache, first=first_cache, seg=seg_BS)
    if self.rest is not None:
      lowest_slot = zero if self.refine_history else cache["history"]

      # Unrolled, one cache per layer (a scan over stacked caches copied them every step).
      rest = []
      for block, layer_cache in zip(decoder.unstacked(self.rest, len(cache["rest"])), cache["rest"]):
        x_BCD, layer_cache = block.extend(x_BCD, positions_BC, layer_cache, first_slot,
                                          lowest_slot, seg_BC, seg_BS)
        rest.append(layer_cache)
      cache["rest"] = rest
    return self.head_logits(x_BCD, last_only), cache


def build(cfg: ModelConfig, rngs: nnx.Rngs, *, route: Route) -> nnx.Module:
  return PerceiverAR(cfg, rngs, route=route)


for _name in VARIANTS:
  registry.register(_name, registry.ModelEntry(
      build=build, context_parallel=False,
      no_context_parallel="no ring version of its latent cross-attention",
      logical_axes=LOGICAL_AXES))
