"""The dense Transformer baseline: causal softmax attention over the whole context.

`model.attention_impl` picks the attention: 'flash' (the blockwise core, O(T)
memory), 'reference' (the dense `[T, T]` einsum) or 'cudnn' (GPU, bfloat16).
With `mesh.context > 1` the ring op is used whatever the impl. Decoding keeps
every key/value (a cache of `max_len` slots per layer): the baseline whose
decode memory and per-token time grow with the context.
"""

import functools

import ml_collections
from flax import nnx

from efficient_lm.models import layers
from efficient_lm.ops import op_set
from efficient_lm.ops.pattern import Pattern


def make_mixer(cfg: ml_collections.ConfigDict, layer: int, rngs: nnx.Rngs, *,
               ops: op_set.OpSet = op_set.SINGLE_DEVICE) -> nnx.Module:
  del layer  # every layer is the same
  op = ops.causal_attention
  if ops.context == 1:
    op = functools.partial(op, impl=cfg.get("attention_impl", "flash"))
  return layers.SelfAttention(cfg.d_model, cfg.num_heads, op,
                              use_rope=cfg.position == "rope", rope_base=cfg.rope_base,
                              dtype=layers.dtype_of(cfg.dtype), rngs=rngs, keys=Pattern.dense())
