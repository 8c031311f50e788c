"""ECP, the Efficient Context Propagating Perceiver (docs/architecture.md), as a decoder mixer.

The sequence is cut into `num_segments` pieces of L = T / num_segments tokens.
Piece t's queries attend to all of piece t - 1 and causally to piece t (piece
0 causally to itself): `Pattern.blocks(L, lookback=1)`.
A pair of consecutive pieces is the paper's PAR block ("history" half, then
"latent" half); every position is a query and every position is trained.
Information travels one piece further back per layer.

Decoding keeps the previous and the current piece's keys/values (2L slots per
layer, a ring): memory independent of the context length.

Options from the authors' code, default off: `shared_kv` (keys and values
from one projection; RoPE rotates the keys only) and `rope_first_layer_only`.
"""

import jax
from flax import nnx

from efficient_lm.config.model import ModelConfig
from efficient_lm.families.ecp import pattern
from efficient_lm.models import layers
from efficient_lm.models import registry
from efficient_lm.ops.pattern import Pattern
from efficient_lm.ops.route import DEFAULT as DEFAULT_ROUTE, Route


class SharedKVAttention(layers.SelfAttention):
  """SelfAttention whose keys and values come from one projection (v is the un-rotated k): q and
  kv one `[D, 2, H, K]` projection `qkv`, or, with grouped heads, `q` and a `[D, 1, H_kv, K]`
  `kv`."""

  def __init__(self, d_model: int, num_heads: int, pattern: Pattern, *, use_rope: bool,
               rope_base: float, dtype, rngs: nnx.Rngs, **kwargs):
    super().__init__(d_model, num_heads, pattern, use_rope=use_rope, rope_base=rope_base,
                     dtype=dtype, rngs=rngs, **kwargs)
    linear = lambda shape, heads: nnx.LinearGeneral(
        d_model, shape, use_bias=False, dtype=dtype, rngs=rngs,
        kernel_metadata=layers.axes("embed", "qkv", heads, "kv"))
    if self.grouped:
      self.kv = linear((1, self.num_kv_heads, d_model // num_heads), "kv_heads")
    else:
      self.qkv = linear((2, num_heads, d_model // num_heads), "heads")

  def project(self, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, ...]:
    if self.grouped:
      q_BTHK, kv_BTHK = self.q(x_BTD), self.kv(x_BTD)[:, :, 0]
    else:
      qkv_BT2HK = self.qkv(x_BTD)
      q_BTHK, kv_BTHK = qkv_BT2HK[:, :, 0], qkv_BT2HK[:, :, 1]
    k_BTHK = kv_BTHK
    if self.use_rope:
      q_BTHK = layers.rope(q_BTHK, positions_BT, self.rope_base)
      k_BTHK = layers.rope(kv_BTHK, positions_BT, self.rope_base)
    return q_BTHK, k_BTHK, kv_BTHK

  def keys_values(self, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    kv_BTHK = self._heads(x_BTD, slice(0, 1) if self.grouped else slice(1, 2))[:, :, 0]
    k_BTHK = layers.rope(kv_BTHK, positions_BT, self.rope_base) if self.use_rope else kv_BTHK
    return k_BTHK, kv_BTHK


def make_mixer(cfg: ModelConfig, layer: int, rngs: nnx.Rngs, *,
               route: Route = DEFAULT_ROUTE) -> nnx.Module:
  """ECP's attention for `layer`."""
  use_rope = cfg.position == "rope" and (layer == 0 or not cfg.rope_first_layer_only)
  module = SharedKVAttention if cfg.shared_kv else layers.SelfAttention
  return module(cfg.d_model, cfg.num_heads, pattern(cfg), route=route, use_rope=use_rope,
                rope_base=cfg.rope_base, dtype=layers.dtype_of(cfg.dtype), rngs=rngs,
                num_kv_heads=cfg.kv_heads)


registry.register("ecp", registry.ModelEntry(make_mixer=make_mixer))
