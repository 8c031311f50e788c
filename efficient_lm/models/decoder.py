"""The shared decoder (docs/architecture.md): embedding, pre-norm residual blocks, norm, head.

Models differ in their *mixer*, built per layer by a factory
`make_mixer(layer, rngs) -> nnx.Module` whose modules are called as
`mixer(x_BTD, positions_BT, segment_ids_BT) -> y_BTD` (document ids, or None:
one document). When every layer has the same settings
(`identical_layers=True`) the blocks are created with `nnx.vmap` and applied
with `nnx.scan`, so compile time does not grow with depth; otherwise (a
per-layer window, a doubling period) they are kept in a list and unrolled.
"""

import logging
from typing import Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from efficient_lm.parallel import sharding
from efficient_lm.config.model import ModelConfig
from efficient_lm.models import chunking
from efficient_lm.models import layers
from efficient_lm.ops import precision
from efficient_lm.ops.pattern import Pattern

class Mixer(Protocol):
  """What a block's mixer must provide (`docs/adding_a_model.md`): the patterns it attends with
  (stated once, read by the registry), the parallel pass over a block's normalized input, the
  pass over a sequence chunk, and cached decoding. `segment_ids` are document ids (None: one
  document); `layers.SelfAttention` provides all of it."""

  @property
  def patterns(self) -> tuple[Pattern, ...]: ...
  def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array,
               segment_ids_BT: jax.Array | None = None) -> jax.Array: ...
  def keys_values(self, x_BWD: jax.Array, positions_BW: jax.Array) -> tuple[jax.Array, jax.Array]: ...
  def attend_chunk(self, x_BCD, positions_BC, k_BWHK, v_BWHK, q_start, k_offset: int,
                   q_align: int, segment_ids=None) -> jax.Array: ...
  def init_cache(self, batch_size: int, max_len: int): ...
  def prefill(self, x_BTD: jax.Array, positions_BT: jax.Array, cache, segment_ids_BT=None): ...
  def extend(self, x_BCD: jax.Array, start: jax.Array, cache, segment_ids_BC=None): ...


@runtime_checkable
class ChunkContext(Protocol):
  """What a chunked mixer with state across the whole sequence adds (BCMT's memory): what each
  chunk receives, computed over all of them first, and how a chunk uses it."""

  def chunk_context(self, window, x_nBCD, positions_nBC, xh_nBHD, ph_nBH, seg_n, starts_n,
                    halo: int, chunk: int): ...
  def attend_chunk_with(self, context, x_BCD, positions_BC, k_BWHK, v_BWHK, q_start,
                        k_offset: int, q_align: int, segment_ids=None) -> jax.Array: ...


MixerFactory = Callable[[int, nnx.Rngs], Mixer]

# Stacked (scanned) layers carry a leading `layers` axis in their logical axis names, never sharded.
LAYERS_AXIS = {nnx.PARTITION_NAME: "layers"}
TOKENS = ("batch", "length", "embed")  # the residual stream's activation axes (`sharding.constrain`)

REMAT_POLICIES = {
    "block": jax.checkpoint_policies.nothing_saveable,       # keep each block's input only
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # and its projections
}


def stacked(make: Callable[[nnx.Rngs], nnx.Module], num: int, rngs: nnx.Rngs) -> nnx.Module:
  """`num` modules `make(rngs)` stacked along a leading `layers` axis (for `nnx.scan`), each with
  its own initialization."""
  @nnx.split_rngs(splits=num)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=LAYERS_AXIS)
  def make_all(rngs: nnx.Rngs) -> nnx.Module:
    return make(rngs)
  return make_all(rngs)


def unstacked(stack: nnx.Module, num: int) -> list:
  """The `num` modules of a `stacked` one, one by one (slices of its parameters)."""
  graphdef, state = nnx.split(stack)
  return [nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state)) for i in range(num)]


def rematerialized(fn: Callable, remat: str, *, in_loop: bool) -> Callable:
  """`fn` under `nnx.remat` with `model.remat`'s policy ('none': `fn` itself). Inside a scan the
  common-subexpression guard is not needed (and costs speed)."""
  if remat == "none":
    return fn
  return nnx.remat(fn, policy=REMAT_POLICIES[remat], prevent_cse=not in_loop)


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
  if message not in _LOGGED:
    _LOGGED.add(message)
    logging.getLogger(__name__).info(message)


def _patterns(mixer) -> tuple[Pattern, ...]:
  patterns = mixer.patterns
  return (patterns,) if isinstance(patterns, Pattern) else tuple(patterns)


class Block(nnx.Module):
  """x + mixer(norm(x)), then x + mlp(norm(x)); dropout on both branches.

  With `model.seq_chunk` = C (and a mixer of bounded reach) the block runs over
  chunks of C tokens in a `lax.map`, each chunk rematerialized: its keys and
  values (with those of the halo before it), queries, attention, gate, residual
  adds and MLP (`models/chunking.py`). The same function; the activations one
  chunk at a time. A length T > C that C does not divide (evaluation or a
  prompt at another length) is padded at the end to a multiple of C: causal
  queries never see the padding, which is cut off after. A sequence of at most
  C tokens is one chunk: the block runs on it whole (said once, in the log).
  """

  def __init__(self, cfg: ModelConfig, mixer: nnx.Module, *, rngs: nnx.Rngs):
    dtype = layers.dtype_of(cfg.dtype)
    self.dropout_rate = cfg.dropout
    self.seq_chunk = cfg.seq_chunk
    self.mixer_norm = layers.rms_norm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.mixer = mixer
    self.mlp_norm = layers.rms_norm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.mlp = layers.Mlp(cfg.d_model, cfg.mlp_ratio, dtype=dtype, rngs=rngs)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, key):
    T, C = x_BTD.shape[1], self.seq_chunk
    if C and T > C:
      if T % C == 0:
        return self.chunked(x_BTD, positions_BT, segment_ids_BT, key)
      if all(p.causal for p in _patterns(self.mixer)):
        return self.chunked_padded(x_BTD, positions_BT, segment_ids_BT, key)
      _log_once(f"model.seq_chunk={C} does not divide a sequence of {T} tokens and the mixer has a "
                "bidirectional pattern (padding would be seen): the block runs on it whole")
    if C:
      _log_once(f"model.seq_chunk={C}: a sequence of {T} <= {C} tokens is one chunk; the block "
                "runs on it whole")
    mixer_key = mlp_key = None
    if key is not None:
      mixer_key, mlp_key = jax.random.split(key)
    y_BTD = self.mixer(self.mixer_norm(x_BTD), positions_BT, segment_ids_BT)
    x_BTD = x_BTD + layers.dropout(y_BTD, self.dropout_rate, mixer_key, positions_BT)
    x_BTD = x_BTD + layers.dropout(self.mlp(self.mlp_norm(x_BTD)), self.dropout_rate, mlp_key,
                                   positions_BT)
    return x_BTD

  def chunked_padded(self, x_BTD, positions_BT, segment_ids_BT, key):
    """`chunked` over T tokens padded at the end to a multiple of `seq_chunk` (the padding's
    positions continue the sequence, its document id is the last token's), then cut back to T.
    Exact: every pattern a chunked mixer has is causal, so no real query sees the padding."""
    T = x_BTD.shape[1]
    pad = -T % self.seq_chunk
    tail = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), mode="edge")
    steps = jnp.arange(pad + 1, dtype=positions_BT.dtype)[1:]
    positions_BT = jnp.concatenate([positions_BT, positions_BT[:, -1:] + steps], axis=1)
    segment_ids_BT = None if segment_ids_BT is None else tail(segment_ids_BT)
    return self.chunked(tail(x_BTD), positions_BT, segment_ids_BT, key)[:, :T]

  def chunked(self, x_BTD, positions_BT, segment_ids_BT, key):
    """`__call__` over chunks of `seq_chunk` tokens (see `models/chunking.py`)."""
    C = self.seq_chunk
    n = x_BTD.shape[1] // C
    halo = chunking.halo(self.mixer.patterns, C)
    x_nBCD, positions_nBC = chunking.split(x_BTD, C), chunking.split(positions_BT, C)
    starts_n = jnp.arange(n, dtype=jnp.int32) * C
    # The inputs of the `halo` positions before each chunk: all a chunk needs of the ones before it.
    xh_nBHD, ph_nBH = chunking.halos(x_nBCD, halo), chunking.halos(positions_nBC, halo)
    # Document ids: each chunk's, and its window's (the halo's and its own); (None, None) without.
    seg_n = (None, None)
    if segment_ids_BT is not None:
      s_nBC = chunking.split(segment_ids_BT.astype(jnp.int32), C)
      # Before the sequence start the halo is never visible (negative positions): any id serves.
      seg_n = (s_nBC, jax.vmap(chunking.window)(chunking.halos(s_nBC, halo), s_nBC))

    def window(x_BCD, positions_BC, xh_BHD, ph_BH):
      """(the chunk's normed inputs, the keys and values of its halo and itself)."""
      h_BWD = self.mixer_norm(chunking.window(xh_BHD, x_BCD))
      k_BWHK, v_BWHK = self.mixer.keys_values(h_BWD, chunking.window(ph_BH, positions_BC))
      return h_BWD[:, halo:], k_BWHK, v_BWHK

    context_n = None
    if isinstance(self.mixer, ChunkContext):
      context_n = self.mixer.chunk_context(window, x_nBCD, positions_nBC, xh_nBHD, ph_nBH, seg_n,
                                           starts_n, halo, C)

    def one_chunk(x_BCD, positions_BC, xh_BHD, ph_BH, seg, start, context):
      mixer_key = mlp_key = None
      if key is not None:  # the whole block's keys: masks follow the absolute positions
        mixer_key, mlp_key = jax.random.split(key)
      h_BCD, k_BWHK, v_BWHK = window(x_BCD, positions_BC, xh_BHD, ph_BH)
      seg = None if seg[0] is None else seg
      args = (h_BCD, positions_BC, k_BWHK, v_BWHK, start, -halo, C, seg)
      if context is None:
        y_BCD = self.mixer.attend_chunk(*args)
      else:
        y_BCD = self.mixer.attend_chunk_with(context, *args)
      x_BCD = x_BCD + layers.dropout(y_BCD, self.dropout_rate, mixer_key, positions_BC)
      return x_BCD + layers.dropout(self.mlp(self.mlp_norm(x_BCD)), self.dropout_rate, mlp_key,
                                    positions_BC)

    return chunking.merge(chunking.map_chunks(one_chunk, x_nBCD, positions_nBC, xh_nBHD, ph_nBH,
                                              seg_n, starts_n, context_n))

  def prefill(self, x_BTD, positions_BT, segment_ids_BT, cache):
    """A prompt through the block (no dropout), filling the mixer's cache."""
    y_BTD, cache = self.mixer.prefill(self.mixer_norm(x_BTD), positions_BT, cache, segment_ids_BT)
    x_BTD = x_BTD + y_BTD
    return x_BTD + self.mlp(self.mlp_norm(x_BTD)), cache

  def extend(self, x_BCD, start, segment_ids_BC, cache):
    """New tokens at positions start.. through the block, against the mixer's cache."""
    y_BCD, cache = self.mixer.extend(self.mixer_norm(x_BCD), start, cache, segment_ids_BC)
    x_BCD = x_BCD + y_BCD
    return x_BCD + self.mlp(self.mlp_norm(x_BCD)), cache


class LanguageModel(nnx.Module):
  """What every model shares around its layers: token (and position) embeddings, input dropout,
  final norm and the output head (tied to the embedding or not).

  Subclasses build their layers after `super().__init__(cfg, rngs)` and implement
  `apply_layers` (everything between the embeddings and the final norm).

  Precision (`model.dtype` is the compute dtype): parameters are float32; the
  residual stream (the embeddings and every block's sum) is float32; matmuls
  run in the compute dtype; norms compute their statistics in float32; the
  output logits are accumulated and returned in float32.
  """

  # Generation places a prompt as it comes (after one end-of-document token); a model that needs
  # a fixed window (Perceiver-AR's history) sets this and gets prompts right-aligned in it.
  prompt_window: int | None = None

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    dtype = layers.dtype_of(cfg.dtype)
    self.compute_dtype = dtype
    self.num_layers = cfg.num_layers
    self.dropout_rate = cfg.dropout
    # Embedding lookups stay float32: they start the float32 residual stream.
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=jnp.float32,
                           embedding_init=nnx.initializers.normal(stddev=cfg.d_model ** -0.5),
                           embedding_metadata=layers.axes("vocab", "embed"), rngs=rngs)
    self.pos_embed = nnx.data(None)
    # Learned positions end at seq_len: no model may be fed (or generate) past it.
    self.max_positions = cfg.seq_len if cfg.position == "learned" else None
    if cfg.position == "learned":
      self.pos_embed = nnx.Embed(cfg.seq_len, cfg.d_model, dtype=jnp.float32,
                                 embedding_init=nnx.initializers.normal(stddev=0.02),
                                 embedding_metadata=layers.axes("positions", "embed"), rngs=rngs)
    self.final_norm = layers.rms_norm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.head = nnx.data(None)
    if not cfg.tie_embeddings:
      self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, rngs=rngs,
                             kernel_metadata=layers.axes("embed", "vocab"))

  def __call__(self, tokens_BT: jax.Array, *, positions_BT: jax.Array | None = None,
               segment_ids_BT: jax.Array | None = None,
               dropout_key: jax.Array | None = None) -> jax.Array:
    """Logits `[B, T', V]` (float32) for int tokens `[B, T]`: the last T' positions (T' = T but
    for Perceiver-AR). `dropout_key=None` means no dropout (evaluation); `positions_BT`
    defaults to 0..T-1 (a context-parallel layout passes its own); `segment_ids_BT` (int `[B, T]`,
    one id per document) keeps every position inside its own document (None: one document)."""
    return self.logits(self.hidden(tokens_BT, positions_BT=positions_BT,
                                   segment_ids_BT=segment_ids_BT, dropout_key=dropout_key))

  def hidden(self, tokens_BT: jax.Array, *, positions_BT: jax.Array | None = None,
             segment_ids_BT: jax.Array | None = None,
             dropout_key: jax.Array | None = None) -> jax.Array:
    """The last layer's outputs `[B, T', D]` (float32), before the final norm and the head: what a
    chunked loss (`train_step.chunked_weighted_nll`) turns into logits a chunk at a time."""
    return self.apply_layers(self.embed_tokens(tokens_BT), positions_BT=positions_BT,
                             segment_ids_BT=segment_ids_BT, dropout_key=dropout_key)

  def from_embeddings(self, x_BTD: jax.Array, *, positions_BT: jax.Array | None = None,
                      segment_ids_BT: jax.Array | None = None,
                      dropout_key: jax.Array | None = None) -> jax.Array:
    """Logits from token embeddings `[B, T, D]` (`embed_tokens`'s output): tests differentiate
    through it to check causality."""
    return self.logits(self.apply_layers(x_BTD, positions_BT=positions_BT,
                                         segment_ids_BT=segment_ids_BT, dropout_key=dropout_key))

  def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
    """Scaled token embeddings `[B, T, D]`, float32 (the input of `apply_layers`)."""
    # The table's `embed` shards gathered first (as FSDP gathers any layer's weights), so the
    # lookup is row-parallel: a lookup from an embed-split table gives rows split along D, which
    # XLA can only re-split along the batch by replicating them.
    table_VD = sharding.constrain(self.embed.embedding[...], "vocab", None)
    x_BTD = jnp.take(table_VD, tokens_BT, axis=0) * jnp.sqrt(jnp.float32(self.embed.features))
    return sharding.constrain(x_BTD, *TOKENS)

  def apply_layers(self, x_BTD: jax.Array, *, positions_BT: jax.Array | None = None,
                   segment_ids_BT: jax.Array | None = None,
                   dropout_key: jax.Array | None = None) -> jax.Array:
    """Embeddings `[B, T, D]` -> the last layer's outputs `[B, T', D]` (T' = T but for Perceiver-AR)."""
    raise NotImplementedError

  # Cached decoding: every model implements init_cache, prefill and extend.

  def init_cache(self, batch_size: int, max_len: int):
    """The decoding state for sequences of up to `max_len` tokens (prompt and generated).

    Only the dense baseline's (and Perceiver-AR's latents') size depends on it;
    the efficient models' caches have a fixed size.
    """
    raise NotImplementedError

  def prefill(self, tokens_BT: jax.Array, cache, segment_ids_BT: jax.Array | None = None, *,
              last_only: bool = False):
    """(what `model(tokens_BT, segment_ids_BT=...)` returns, the cache after it): one parallel
    pass over a prompt at positions 0..T-1, from a fresh cache. `last_only`: the logits at the
    last position only, `[B, 1, V]` (what decoding reads: the head over every position of a
    prompt is most of its prefill's work and memory at a large vocabulary)."""
    raise NotImplementedError

  def extend(self, tokens_BC: jax.Array, cache, start: jax.Array,
             segment_ids_BC: jax.Array | None = None, *, last_only: bool = False):
    """(logits `[B, C, V]`, cache) for C tokens at positions start..start+C-1 after the cached
    ones: C = 1 is a decoding step, larger C a chunk of a long prompt. `segment_ids_BC`: their
    document ids (in the numbering the earlier ones used; None: document 0). `last_only`: as in
    `prefill`, `[B, 1, V]`."""
    raise NotImplementedError

  def head_logits(self, x_BTD: jax.Array, last_only: bool) -> jax.Array:
    """`logits` of the final hidden states, or of the last position's alone (`prefill`)."""
    return self.logits(x_BTD[:, -1:] if last_only else x_BTD)

  def decode_step(self, tokens_B: jax.Array, cache, position: jax.Array,
                  segment_ids_B: jax.Array | None = None):
    """Logits `[B, V]` for one token per sequence at `position` (a scalar), and the new cache."""
    ids = None if segment_ids_B is None else segment_ids_B[:, None]
    logits_B1V, cache = self.extend(tokens_B[:, None], cache, position, ids)
    return logits_B1V[:, 0], cache

  def decoding_view(self) -> "LanguageModel":
    """The model as a loop of decoding steps should hold it: itself, or (`Decoder` with scanned
    layers) a copy with the layers' parameters sliced once, outside the loop."""
    return self

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
    x_BTD = sharding.constrain(layers.dropout(x_BTD, self.dropout_rate, embed_key), *TOKENS)
    return x_BTD, positions_BT, layer_keys

  def logits(self, x_BTD: jax.Array) -> jax.Array:
    """Float32 logits `[B, T, V]`: the final norm, then the head's matmul in the compute dtype
    accumulated in float32 (never rounded to the compute dtype on the way)."""
    x_BTD = self.final_norm(x_BTD).astype(self.compute_dtype)
    if self.head is None:
      embedding_VD = self.embed.embedding[...].astype(self.compute_dtype)
      B, T, _ = x_BTD.shape
      if T == 1 and B <= 16 and precision.platform() == "cpu":
        # Decoding a few rows on CPU: logits vocabulary-major, `[V, B]` (the embedding the
        # matmul's left operand), transposed after a barrier, else XLA folds the transpose back
        # into the `[B, V]` dot, which XLA:CPU ran 1.5x slower at B = 8 (d 256, 16K vocabulary,
        # in a π decoding step: 2.1 -> 1.4 ms; 0.7 ms at B = 1). From B = 32 the `[B, V]` dot is
        # faster (the transpose costs more), so larger batches keep it.
        logits_VB = precision.einsum_f32("vd,bd->vb", embedding_VD, x_BTD[:, 0])
        logits_BTV = jax.lax.optimization_barrier(logits_VB).T[:, None]
      else:
        logits_BTV = precision.einsum_f32("btd,vd->btv", x_BTD, embedding_VD)
    else:
      kernel_DV = self.head.kernel[...].astype(self.compute_dtype)
      logits_BTV = precision.einsum_f32("btd,dv->btv", x_BTD, kernel_DV)
    return sharding.constrain(logits_BTV, "batch", "length", "vocab")


class Decoder(LanguageModel):
  """Token embedding -> blocks -> final norm -> logits over the vocabulary."""

  def __init__(self, cfg: ModelConfig, make_mixer: MixerFactory, *,
               identical_layers: bool, rngs: nnx.Rngs):
    super().__init__(cfg, rngs)
    self.scanned = identical_layers
    self.remat = cfg.remat
    if identical_layers:
      self.blocks = stacked(lambda rngs: Block(cfg, make_mixer(0, rngs), rngs=rngs),
                            cfg.num_layers, rngs)
    else:
      self.blocks = nnx.List([Block(cfg, make_mixer(i, rngs), rngs=rngs)
                              for i in range(cfg.num_layers)])

  def apply_layers(self, x_BTD: jax.Array, *, positions_BT: jax.Array | None = None,
                   segment_ids_BT: jax.Array | None = None,
                   dropout_key: jax.Array | None = None) -> jax.Array:
    x_BTD, positions_BT, layer_keys = self.prepare_input(x_BTD, positions_BT, dropout_key)
    apply_block = rematerialized(
        lambda block, x, positions, segments, key: sharding.constrain(
            block(x, positions, segments, key), *TOKENS),
        self.remat, in_loop=self.scanned)
    if self.scanned:
      keys = None if layer_keys[0] is None else layer_keys

      @nnx.scan(in_axes=(nnx.Carry, 0, None, None, 0 if keys is not None else None),
                out_axes=nnx.Carry, transform_metadata=LAYERS_AXIS)
      def apply_blocks(x_BTD, block, positions_BT, segment_ids_BT, key):
        return apply_block(block, x_BTD, positions_BT, segment_ids_BT, key)

      return apply_blocks(x_BTD, self.blocks, positions_BT, segment_ids_BT, keys)
    for block, key in zip(self.blocks, layer_keys):
      x_BTD = apply_block(block, x_BTD, positions_BT, segment_ids_BT, key)
    return x_BTD

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
    return unstacked(self.blocks, self.num_layers) if self.scanned else list(self.blocks)

  def decoding_view(self) -> "Decoder":
    """A scanned stack's layers sliced into a list of blocks (the same parameters), so a decoding
    loop that carries the view's parameters does not slice every layer's weights at every step
    (about 1 ms a step at d_model 256, 2 layers, on CPU)."""
    if not self.scanned:
      return self
    view = nnx.merge(*nnx.split(self))
    view.blocks = nnx.List(self.layer_blocks())
    view.scanned = False
    return view

  def _through_blocks(self, apply: Callable, x_BTD: jax.Array, cache: list):
    """`apply(block, x, layer_cache) -> (x, layer_cache)` through every layer, the caches updated.

    Unrolled over the layers even when they are scanned for training: with the
    layer caches as slices of one stacked buffer, XLA copied every layer's cache
    in and out of the loop at each decoding step.
    """
    new_cache = []
    for block, layer_cache in zip(self.layer_blocks(), cache):
      x_BTD, layer_cache = apply(block, x_BTD, layer_cache)
      new_cache.append(layer_cache)
    return x_BTD, new_cache

  def prefill(self, tokens_BT: jax.Array, cache, segment_ids_BT: jax.Array | None = None, *,
              last_only: bool = False):
    x_BTD, positions_BT, _ = self.prepare_input(self.embed_tokens(tokens_BT), None, None)
    x_BTD, cache = self._through_blocks(
        lambda block, x, c: block.prefill(x, positions_BT, segment_ids_BT, c), x_BTD, cache)
    return self.head_logits(x_BTD, last_only), cache

  def extend(self, tokens_BC: jax.Array, cache, start: jax.Array,
             segment_ids_BC: jax.Array | None = None, *, last_only: bool = False):
    B, C = tokens_BC.shape
    start = jnp.asarray(start, jnp.int32)
    _, positions_BC = layers.chunk_positions(start, B, C)
    x_BCD, _, _ = self.prepare_input(self.embed_tokens(tokens_BC), positions_BC, None)
    x_BCD, cache = self._through_blocks(
        lambda block, x, c: block.extend(x, start, segment_ids_BC, c), x_BCD, cache)
    return self.head_logits(x_BCD, last_only), cache
