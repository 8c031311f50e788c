"""The Perceiver-AR family (SPEC section 6): PerceiverAR and the three double-attention variants.

Every layer works on a stream `[history; latents]`: the latents are the last
Z = `num_latents` positions, the history the T - Z before them. The latent
queries cross-attend causally to the whole stream (`causal_cross_attention`,
the one primitive all four share). What differs is what becomes of the history:

- `perceiver_ar`: used as keys/values in layer 1 only, then dropped; layers
  2.. are causal self-attention over the latents (the same primitive with no
  history).
- `double_attention`: kept in every layer and refined by its own
  bidirectional self-attention (no history position is ever predicted).
- `compressed_double_attention`: as double, on a history first compressed
  along the sequence by a learned linear map (T - Z -> (T - Z) / compression).
- `ssplit_double_attention`: as double, the history's self-attention kept
  inside `num_history_segments` disjoint segments.

The model returns logits for the latent positions only, `[B, Z, V]`; the
training loop scores them against the last Z targets, so only latents are
trained. History and latents share each layer's weights (one q/k/v
projection, one MLP).
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from efficient_lm.models import decoder
from efficient_lm.models import layers
from efficient_lm.ops.cross_attention import causal_cross_attention, segment_attention
from efficient_lm.validation import require, require_positive_int


@dataclasses.dataclass(frozen=True)
class Variant:
  refine_history: bool  # keep the history in every layer, refined by its own self-attention
  compress: bool        # compress the history along the sequence before layer 1
  split_history: bool   # history self-attention inside num_history_segments segments


VARIANTS = {
    "perceiver_ar": Variant(refine_history=False, compress=False, split_history=False),
    "double_attention": Variant(refine_history=True, compress=False, split_history=False),
    "compressed_double_attention": Variant(refine_history=True, compress=True, split_history=False),
    "ssplit_double_attention": Variant(refine_history=True, compress=False, split_history=True),
}


def _divisor_hint(n: int, near: int) -> int:
  """The divisor of n closest to `near` (for error messages)."""
  return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - near), default=1)


def validate(cfg: ml_collections.ConfigDict) -> None:
  require_positive_int("model.num_latents", cfg.num_latents)
  require(cfg.num_latents <= cfg.seq_len, "model.num_latents", cfg.num_latents,
          f"must be at most model.seq_len={cfg.seq_len}",
          f"set model.num_latents to at most {cfg.seq_len}, e.g. {max(1, cfg.seq_len // 2)}")
  history = cfg.seq_len - cfg.num_latents
  variant = VARIANTS[cfg.name]
  for used, field in ((variant.compress, "compression"), (variant.split_history, "num_history_segments")):
    if used:
      require_positive_int(f"model.{field}", cfg[field])
      require(history % cfg[field] == 0, f"model.{field}", cfg[field],
              f"must divide the history length model.seq_len - model.num_latents = {history}",
              f"set model.{field} to a divisor of {history}, e.g. {_divisor_hint(history, cfg[field])}")


def mean_pool_matrix(history: int, compression: int) -> jax.Array:
  """`[history, history / compression]`: slot c is the mean of history tokens c*comp .. (c+1)*comp - 1."""
  h = jnp.arange(history)[:, None]
  c = jnp.arange(history // compression)[None, :]
  return jnp.where(h // compression == c, 1.0 / compression, 0.0).astype(jnp.float32)


class PerceiverBlock(nnx.Module):
  """One layer over `x_BSD` = [history; latents] (history may be empty); returns what is kept.

  Latent queries: `causal_cross_attention` over the whole stream. History
  queries (if `refine_history`): `segment_attention` over the history. Without
  `refine_history` the history is dropped after serving as keys/values. Then
  the MLP on the kept stream. Pre-norm residual branches with dropout, as the
  shared decoder's Block.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, *, refine_history: bool,
               history_segments: int, rngs: nnx.Rngs):
    dtype = layers.dtype_of(cfg.dtype)
    self.num_latents = cfg.num_latents
    self.refine_history = refine_history
    self.history_segments = history_segments
    self.dropout_rate = cfg.dropout
    self.mixer_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.attn = layers.SelfAttention(cfg.d_model, cfg.num_heads, None,
                                     use_rope=cfg.position == "rope", rope_base=cfg.rope_base,
                                     dtype=dtype, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.mlp = layers.Mlp(cfg.d_model, cfg.mlp_ratio, dtype=dtype, rngs=rngs)

  def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, key: jax.Array | None) -> jax.Array:
    B, S, D = x_BSD.shape
    history = S - self.num_latents
    mixer_key = mlp_key = None
    if key is not None:
      mixer_key, mlp_key = jax.random.split(key)
    q_BSHK, k_BSHK, v_BSHK = self.attn.project(self.mixer_norm(x_BSD), positions_BS)
    o_BZHK = causal_cross_attention(q_BSHK[:, history:], k_BSHK, v_BSHK, query_offset=history)
    if self.refine_history:
      o_BHHK = segment_attention(q_BSHK[:, :history], k_BSHK[:, :history], v_BSHK[:, :history],
                                 num_segments=self.history_segments)
      o_BSHK = jnp.concatenate([o_BHHK, o_BZHK], axis=1)
    else:
      o_BSHK, x_BSD = o_BZHK, x_BSD[:, history:]
    x_BSD = x_BSD + layers.dropout(self.attn.out(o_BSHK.reshape(B, x_BSD.shape[1], D)),
                                   self.dropout_rate, mixer_key)
    x_BSD = x_BSD + layers.dropout(self.mlp(self.mlp_norm(x_BSD)), self.dropout_rate, mlp_key)
    return x_BSD


class PerceiverAR(decoder.LanguageModel):
  """Embedding -> (compression) -> layer 1 -> scanned layers 2.. -> norm -> logits of the latents."""

  def __init__(self, cfg: ml_collections.ConfigDict, rngs: nnx.Rngs):
    super().__init__(cfg, rngs)
    variant = VARIANTS[cfg.name]
    self.num_latents = cfg.num_latents
    self.refine_history = variant.refine_history
    history = cfg.seq_len - cfg.num_latents
    self.compression = cfg.compression if variant.compress else 1
    self.compress = nnx.data(None)
    if variant.compress and history > 0:  # learned, initialized to mean pooling of consecutive tokens
      self.compress = nnx.Param(mean_pool_matrix(history, self.compression))
    segments = cfg.num_history_segments if variant.split_history else 1

    def make_block(rngs: nnx.Rngs) -> PerceiverBlock:
      return PerceiverBlock(cfg, refine_history=variant.refine_history, history_segments=segments,
                            rngs=rngs)

    self.first = make_block(rngs)
    self.rest = nnx.data(None)
    if cfg.num_layers > 1:  # identical layers: stacked and applied with nnx.scan
      @nnx.split_rngs(splits=cfg.num_layers - 1)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make_rest(rngs: nnx.Rngs) -> PerceiverBlock:
        return make_block(rngs)
      self.rest = make_rest(rngs)

  def decode(self, x_BTD: jax.Array, *, positions_BT: jax.Array | None = None,
             dropout_key: jax.Array | None = None) -> jax.Array:
    """Everything after the token lookup; logits `[B, Z, V]` of the latent positions."""
    B, T, _ = x_BTD.shape
    Z = self.num_latents
    if T < Z:
      raise ValueError(f"sequence length {T} is shorter than model.num_latents={Z}")
    x_BSD, positions_BT, layer_keys = self.prepare_input(x_BTD, positions_BT, dropout_key)
    positions_BS = positions_BT

    if self.compress is not None:
      history, c = T - Z, self.compression
      if history != self.compress.shape[0]:
        raise ValueError(f"the compressed model was built for a history of {self.compress.shape[0]} "
                         f"tokens (model.seq_len - model.num_latents), got {history}")
      compressed_BCD = jnp.einsum("bhd,hc->bcd", x_BSD[:, :history],
                                  self.compress[...].astype(x_BSD.dtype))
      x_BSD = jnp.concatenate([compressed_BCD, x_BSD[:, history:]], axis=1)
      # A compressed slot takes the position of the last token of the chunk it was initialized to pool.
      positions_BS = jnp.concatenate([positions_BT[:, c - 1:history:c], positions_BT[:, history:]],
                                     axis=1)

    x_BSD = self.first(x_BSD, positions_BS, layer_keys[0])
    if not self.refine_history:
      positions_BS = positions_BS[:, -Z:]
    if self.rest is not None:
      keys = None if layer_keys[0] is None else layer_keys[1:]

      @nnx.scan(in_axes=(nnx.Carry, 0, None, 0 if keys is not None else None), out_axes=nnx.Carry)
      def apply_blocks(x_BSD, block, positions_BS, key):
        return block(x_BSD, positions_BS, key)

      x_BSD = apply_blocks(x_BSD, self.rest, positions_BS, keys)

    return self.logits(x_BSD[:, -Z:])


def build(cfg: ml_collections.ConfigDict, rngs: nnx.Rngs) -> nnx.Module:
  return PerceiverAR(cfg, rngs)
