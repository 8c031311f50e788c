"""The dense Transformer baseline: causal softmax attention over the whole context."""

import ml_collections
from flax import nnx

from efficient_lm.models import layers
from efficient_lm.ops import attention


def make_mixer(cfg: ml_collections.ConfigDict, layer: int, rngs: nnx.Rngs) -> nnx.Module:
  del layer  # every layer is the same
  return layers.SelfAttention(cfg.d_model, cfg.num_heads, attention.causal_attention,
                              use_rope=cfg.position == "rope", rope_base=cfg.rope_base,
                              dtype=layers.dtype_of(cfg.dtype), rngs=rngs)
