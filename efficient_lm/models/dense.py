"""The dense Transformer baseline: causal softmax attention over the whole context.

`model.attention_impl` picks the attention backend like every model's
(`ops.core.backends`: 'xla' or its earlier name 'flash', the blockwise core,
O(T) memory; 'reference', the dense `[T, T]` masked softmax; 'gpu' / 'cudnn'
and 'splash' the GPU and TPU kernels; 'auto' per platform); with
`mesh.context > 1` the route runs ring attention on it (zig-zag layout).
Decoding keeps every key/value (a cache of `max_len` slots per layer): the
baseline whose decode memory and per-token time grow with the context.
"""

from flax import nnx

from efficient_lm.config.model import ModelConfig
from efficient_lm.models import layers
from efficient_lm.models import registry
from efficient_lm.ops.pattern import Pattern
from efficient_lm.ops.route import DEFAULT as DEFAULT_ROUTE, Route


def make_mixer(cfg: ModelConfig, layer: int, rngs: nnx.Rngs, *,
               route: Route = DEFAULT_ROUTE) -> nnx.Module:
  del layer  # every layer is the same
  return layers.SelfAttention(cfg.d_model, cfg.num_heads, Pattern.dense(), route=route,
                              use_rope=cfg.position == "rope", rope_base=cfg.rope_base,
                              dtype=layers.dtype_of(cfg.dtype), rngs=rngs,
                              num_kv_heads=cfg.kv_heads)


registry.register("dense", registry.ModelEntry(make_mixer=make_mixer))
