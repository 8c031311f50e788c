"""The shared decoder (docs/architecture.md): embedding, pre-norm residual blocks, norm, head.

Models differ in their *mixer*, built per layer by a factory
`make_mixer(layer, rngs) -> nnx.Module` whose modules are called as
`mixer(x_BTD, positions_BT) -> y_BTD`. When every layer has the same settings
(`identical_layers=True`) the blocks are created with `nnx.vmap` and applied
with `nnx.scan`, so compile time does not grow with depth; otherwise (a
per-layer window, a doubling period) they are kept in a list and unrolled.
"""

from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from efficient_lm.models import layers

MixerFactory = Callable[[int, nnx.Rngs], nnx.Module]


class Block(nnx.Module):
  """x + mixer(norm(x)), then x + mlp(norm(x)); dropout on both branches."""

  def __init__(self, cfg: ml_collections.ConfigDict, mixer: nnx.Module, *, rngs: nnx.Rngs):
    dtype = layers.dtype_of(cfg.dtype)
    self.dropout_rate = cfg.dropout
    self.mixer_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.mixer = mixer
    self.mlp_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.mlp = layers.Mlp(cfg.d_model, cfg.mlp_ratio, dtype=dtype, rngs=rngs)

  def __call__(self, x_BTD, positions_BT, key):
    mixer_key = mlp_key = None
    if key is not None:
      mixer_key, mlp_key = jax.random.split(key)
    x_BTD = x_BTD + layers.dropout(self.mixer(self.mixer_norm(x_BTD), positions_BT),
                                   self.dropout_rate, mixer_key)
    x_BTD = x_BTD + layers.dropout(self.mlp(self.mlp_norm(x_BTD)), self.dropout_rate, mlp_key)
    return x_BTD

  def prefill(self, x_BTD, positions_BT, cache):
    """A prompt through the block (no dropout), filling the mixer's cache."""
    y_BTD, cache = self.mixer.prefill(self.mixer_norm(x_BTD), positions_BT, cache)
    x_BTD = x_BTD + y_BTD
    return x_BTD + self.mlp(self.mlp_norm(x_BTD)), cache

  def extend(self, x_BCD, start, cache):
    """New tokens at positions start.. through the block, against the mixer's cache."""
    y_BCD, cache = self.mixer.extend(self.mixer_norm(x_BCD), start, cache)
    x_BCD = x_BCD + y_BCD
    return x_BCD + self.mlp(self.mlp_norm(x_BCD)), cache


class LanguageModel(nnx.Module):
  """What every model shares around its layers: token (and position) embeddings, input dropout,
  final norm and the output head (tied to the embedding or not).

  Subclasses build their layers after `super().__init__(cfg, rngs)` and implement `decode`.
  """

  # Generation places a prompt as it comes (after one end-of-document token); a model that needs
  # a fixed window (Perceiver-AR's history) sets this and gets prompts right-aligned in it.
  prompt_window: int | None = None

  def __init__(self, cfg: ml_collections.ConfigDict, rngs: nnx.Rngs):
    dtype = layers.dtype_of(cfg.dtype)
    self.num_layers = cfg.num_layers
    self.dropout_rate = cfg.dropout
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype,
                           embedding_init=nnx.initializers.normal(stddev=cfg.d_model ** -0.5),
                           rngs=rngs)
    self.pos_embed = nnx.data(None)
    # Learned positions end at seq_len: no model may be fed (or generate) past it.
    self.max_positions = cfg.seq_len if cfg.position == "learned" else None
    if cfg.position == "learned":
      self.pos_embed = nnx.Embed(cfg.seq_len, cfg.d_model, dtype=dtype,
                                 embedding_init=nnx.initializers.normal(stddev=0.02), rngs=rngs)
    self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.head = nnx.data(None)
    if not cfg.tie_embeddings:
      self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, tokens_BT: jax.Array, *, positions_BT: jax.Array | None = None,
               dropout_key: jax.Array | None = None) -> jax.Array:
    """Logits `[B, T', V]` (float32) for int tokens `[B, T]`: the last T' positions (T' = T but
    for Perceiver-AR). `dropout_key=None` means no dropout (evaluation); `positions_BT`
    defaults to 0..T-1 (a context-parallel layout passes its own)."""
    return self.decode(self.embed_tokens(tokens_BT), positions_BT=positions_BT,
                       dropout_key=dropout_key)

  def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
    """Scaled token embeddings `[B, T, D]` (the input of `decode`)."""
    return self.embed(tokens_BT) * jnp.sqrt(self.embed.features).astype(self.embed.dtype or jnp.float32)

  def decode(self, x_BTD: jax.Array, *, positions_BT: jax.Array | None = None,
             dropout_key: jax.Array | None = None) -> jax.Array:
    """Everything after the token lookup; tests differentiate through it to check causality."""
    raise NotImplementedError

  # Cached decoding: every model implements init_cache, prefill and extend.

  def init_cache(self, batch_size: int, max_len: int):
    """The decoding state for sequences of up to `max_len` tokens (prompt and generated).

    Only the dense baseline's (and Perceiver-AR's latents') size depends on it;
    the efficient models' caches have a fixed size.
    """
    raise NotImplementedError

  def prefill(self, tokens_BT: jax.Array, cache):
    """(what `model(tokens_BT)` returns, the cache after it): one parallel pass over a prompt
    at positions 0..T-1, from a fresh cache."""
    raise NotImplementedError

  def extend(self, tokens_BC: jax.Array, cache, start: jax.Array):
    """(logits `[B, C, V]`, cache) for C tokens at positions start..start+C-1 after the cached
    ones: C = 1 is a decoding step, larger C a chunk of a long prompt."""
    raise NotImplementedError

  def decode_step(self, tokens_B: jax.Array, cache, position: jax.Array):
    """Logits `[B, V]` for one token per sequence at `position` (a scalar), and the new cache."""
    logits_B1V, cache = self.extend(tokens_B[:, None], cache, position)
    return logits_B1V[:, 0], cache

  def prepare_input(self, x_BTD: jax.Array, positions_BT: jax.Array | None,
                    dropout_key: jax.Array | None) -> tuple[jax.Array, jax.Array, list]:
    """(x with position embeddings and dropout, positions, one dropout key per layer or Nones)."""
    B, T, _ = x_BTD.shape
    if self.max_positions is not None and T > self.max_positions:
      raise ValueError(f"{T} tokens exceed model.seq_len={self.max_positions}, the number of learned "
                       "position embeddings; feed at most that many, or use model.position='rope'")
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if self.pos_embed is not None:
      x_BTD = x_BTD + self.pos_embed(positions_BT)
    embed_key = None
    layer_keys = [None] * self.num_layers
    if dropout_key is not None and self.dropout_rate > 0:
      embed_key, layers_key = jax.random.split(dropout_key)
      layer_keys = jax.random.split(layers_key, self.num_layers)
    return layers.dropout(x_BTD, self.dropout_rate, embed_key), positions_BT, layer_keys

  def logits(self, x_BTD: jax.Array) -> jax.Array:
    x_BTD = self.final_norm(x_BTD)
    if self.head is None:
      logits_BTV = self.embed.attend(x_BTD)
    else:
      logits_BTV = self.head(x_BTD)
    return logits_BTV.astype(jnp.float32)


class Decoder(LanguageModel):
  """Token embedding -> blocks -> final norm -> logits over the vocabulary."""

  def __init__(self, cfg: ml_collections.ConfigDict, make_mixer: MixerFactory, *,
               identical_layers: bool, rngs: nnx.Rngs):
    super().__init__(cfg, rngs)
    self.scanned = identical_layers
    if identical_layers:
      @nnx.split_rngs(splits=cfg.num_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make_blocks(rngs: nnx.Rngs) -> Block:
        return Block(cfg, make_mixer(0, rngs), rngs=rngs)
      self.blocks = make_blocks(rngs)
    else:
      self.blocks = nnx.List([Block(cfg, make_mixer(i, rngs), rngs=rngs)
                              for i in range(cfg.num_layers)])

  def decode(self, x_BTD: jax.Array, *, positions_BT: jax.Array | None = None,
             dropout_key: jax.Array | None = None) -> jax.Array:
    x_BTD, positions_BT, layer_keys = self.prepare_input(x_BTD, positions_BT, dropout_key)
    if self.scanned:
      keys = None if layer_keys[0] is None else layer_keys

      @nnx.scan(in_axes=(nnx.Carry, 0, None, 0 if keys is not None else None), out_axes=nnx.Carry)
      def apply_blocks(x_BTD, block, positions_BT, key):
        return block(x_BTD, positions_BT, key)

      x_BTD = apply_blocks(x_BTD, self.blocks, positions_BT, keys)
    else:
      for block, key in zip(self.blocks, layer_keys):
        x_BTD = block(x_BTD, positions_BT, key)

    return self.logits(x_BTD)

  # Cached decoding: every mixer has init_cache, prefill and extend.

  def init_cache(self, batch_size: int, max_len: int) -> list:
    """Every layer's decoding state, one entry per layer (separate buffers, updated in place)."""
    if self.max_positions is not None and max_len > self.max_positions:
      raise ValueError(f"max_len={max_len} exceeds model.seq_len={self.max_positions}, the number of "
                       f"learned position embeddings; decode at most {self.max_positions} tokens")
    if self.scanned:
      one = self.blocks.mixer.init_cache(batch_size, max_len)  # shapes only: no parameter is read
      return [jax.tree.map(jnp.copy, one) for _ in range(self.num_layers)]
    return [block.mixer.init_cache(batch_size, max_len) for block in self.blocks]

  def layer_blocks(self) -> list:
    """The blocks one by one (a scanned stack sliced per layer)."""
    if not self.scanned:
      return list(self.blocks)
    graphdef, state = nnx.split(self.blocks)
    return [nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state)) for i in range(self.num_layers)]

  def _through_blocks(self, method: str, x_BTD: jax.Array, where, cache: list):
    """`Block.<method>(x, where, layer_cache)` through every layer, the caches updated.

    Unrolled over the layers even when they are scanned for training: with the
    layer caches as slices of one stacked buffer, XLA copied every layer's cache
    in and out of the loop at each decoding step.
    """
    new_cache = []
    for block, layer_cache in zip(self.layer_blocks(), cache):
      x_BTD, layer_cache = getattr(block, method)(x_BTD, where, layer_cache)
      new_cache.append(layer_cache)
    return x_BTD, new_cache

  def prefill(self, tokens_BT: jax.Array, cache):
    x_BTD, positions_BT, _ = self.prepare_input(self.embed_tokens(tokens_BT), None, None)
    x_BTD, cache = self._through_blocks("prefill", x_BTD, positions_BT, cache)
    return self.logits(x_BTD), cache

  def extend(self, tokens_BC: jax.Array, cache, start: jax.Array):
    B, C = tokens_BC.shape
    start = jnp.asarray(start, jnp.int32)
    _, positions_BC = layers.chunk_positions(start, B, C)
    x_BCD, _, _ = self.prepare_input(self.embed_tokens(tokens_BC), positions_BC, None)
    x_BCD, cache = self._through_blocks("extend", x_BCD, start, cache)
    return self.logits(x_BCD), cache
