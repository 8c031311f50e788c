"""π-Attention (docs/architecture.md, "π-Attention") and its baseline, sliding-window attention.

π mixer: q, k, v; a per-token, per-head gate from a small MLP on the token's
representation; attention over `Pattern.pi` (local window + periodic skips)
with the gate as log-priors (one softmax); output projection. The baseline is
the same window with no skips and no gate ("RingAttention" in the paper's
tables).

Per-layer settings: `model.window`, `model.period` and `model.num_skips` are
scalars; `model.period_schedule='doubling'` gives layer l the period
`period * 2**l` (the growing-period reading of the paper's O(k n_l + P log n_l)
receptive field), `'constant'` the same period everywhere. Layers whose
settings differ are unrolled; identical ones are scanned.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from efficient_lm.config import axes
from efficient_lm.config.model import ModelConfig
from efficient_lm.families.pi_attention import layer_pattern
from efficient_lm.models import layers
from efficient_lm.models import registry
from efficient_lm.ops import precision
from efficient_lm.ops.priors import gate_priors
from efficient_lm.ops.pattern import Pattern
from efficient_lm.ops.route import DEFAULT as DEFAULT_ROUTE, Route

LOGICAL_AXES = axes.FAMILY_AXES["pi_attention"]  # (declared without jax: efficient_lm/config/axes.py)


class LocalMixer(nnx.Module):
  """The π mixer (`gated=True`: the window and the layer's skips, with the gate's log-priors) and
  the sliding-window one (`gated=False`: the window alone). Its attention is a
  `layers.SelfAttention` over `pattern`, in every mode; the gate only adds the priors.

  Cached decoding keeps a ring buffer of the last max(window, num_skips * period + 1)
  keys and values per layer (the window and the farthest skip bound what any
  later token reads): memory independent of the context length, not of the
  period (with a doubling period deeper layers hold more).
  """

  def __init__(self, cfg: ModelConfig, pattern: Pattern, *, gated: bool,
               route: Route, rngs: nnx.Rngs):
    dtype = layers.dtype_of(cfg.dtype)
    self.gated = gated
    self.attn = layers.SelfAttention(cfg.d_model, cfg.num_heads, pattern, route=route,
                                     use_rope=cfg.position == "rope", rope_base=cfg.rope_base,
                                     dtype=dtype, rngs=rngs, num_kv_heads=cfg.kv_heads)
    self.gate_in = nnx.data(None)
    self.gate_out = nnx.data(None)
    self.fixed_gate = gated and cfg.gate == "fixed"
    if gated and not self.fixed_gate:
      self.gate_in = nnx.Linear(cfg.d_model, cfg.gate_hidden, dtype=dtype, rngs=rngs,
                                kernel_metadata=layers.axes("embed", "gate_hidden"),
                                bias_metadata=layers.axes("gate_hidden"))
      self.gate_out = nnx.Linear(cfg.gate_hidden, cfg.num_heads, dtype=dtype, rngs=rngs,
                                 kernel_metadata=layers.axes("gate_hidden", "heads"),
                                 bias_metadata=layers.axes("heads"))

  @property
  def pattern(self) -> Pattern:
    return self.attn.pattern

  @property
  def patterns(self) -> tuple[Pattern, ...]:
    return self.attn.patterns

  def gate_logits(self, x_BTD: jax.Array) -> jax.Array:
    """The logit z of the local part's prior weight g = sigmoid(z), per token and head, float32:
    the priors are log_sigmoid(+-z), exact at any z (a sigmoid rounds g to 1 from z ~ 17 in
    float32, from z ~ 6 in bfloat16). The gate MLP's hidden layer runs in the compute dtype.
    `model.gate='fixed'`: z = 0 (g = 0.5), the window and the skips weighed equally."""
    if self.fixed_gate:
      return jnp.zeros((*x_BTD.shape[:2], self.attn.num_heads), jnp.float32)
    hidden_BTG = jax.nn.gelu(self.gate_in(x_BTD))
    kernel_GH = self.gate_out.kernel[...].astype(hidden_BTG.dtype)
    return (precision.einsum_f32("btg,gh->bth", hidden_BTG, kernel_GH)
            + self.gate_out.bias[...].astype(jnp.float32))

  def gate(self, x_BTD: jax.Array) -> jax.Array:
    """The prior weight of the local part, per token and head, in (0, 1)."""
    return jax.nn.sigmoid(self.gate_logits(x_BTD))

  def priors(self, x_BTD: jax.Array) -> dict:
    """{local_prior, skip_prior} `[B, T, H]`, float32: log g and log(1 - g); {} without a gate or
    with no skip (then log g shifts every logit of a row equally)."""
    if not self.gated or not self.pattern.has_skips:
      return {}
    local_BTH, skip_BTH = gate_priors(gate_logits_BTH=self.gate_logits(x_BTD))
    return {"local_prior": local_BTH, "skip_prior": skip_BTH}

  def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array,
               segment_ids_BT: jax.Array | None = None) -> jax.Array:
    return self.attn(x_BTD, positions_BT, segment_ids_BT, **self.priors(x_BTD))

  # Sequence-chunked blocks (`models/chunking.py`).

  def keys_values(self, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    return self.attn.keys_values(x_BTD, positions_BT)

  def attend_chunk(self, x_BCD, positions_BC, k_BWHK, v_BWHK, q_start, k_offset, q_align,
                   segment_ids=None) -> jax.Array:
    return self.attn.attend_chunk(x_BCD, positions_BC, k_BWHK, v_BWHK, q_start, k_offset,
                                  q_align, segment_ids, **self.priors(x_BCD))

  # Cached decoding: the attention's ring buffer, the same priors as the parallel pass.

  @property
  def skip_offsets(self) -> list[int]:
    return list(self.pattern.skip_offsets())

  @property
  def cache_span(self) -> int:
    """Keys any future token can still attend to: its window and its farthest skip."""
    return self.pattern.reach + 1

  def init_cache(self, batch_size: int, max_len: int = 0) -> dict:
    """`max_len` is not needed: the span is fixed by the window and the skips."""
    del max_len
    return self.attn.init_cache(batch_size, self.cache_span)

  def prefill(self, x_BTD: jax.Array, positions_BT: jax.Array, cache: dict,
              segment_ids_BT: jax.Array | None = None) -> tuple[jax.Array, dict]:
    return self.attn.prefill(x_BTD, positions_BT, cache, segment_ids_BT, **self.priors(x_BTD))

  def extend(self, x_BCD: jax.Array, start: jax.Array, cache: dict,
             segment_ids_BC: jax.Array | None = None) -> tuple[jax.Array, dict]:
    return self.attn.extend(x_BCD, start, cache, segment_ids_BC, **self.priors(x_BCD))


def make_pi_mixer(cfg: ModelConfig, layer: int, rngs: nnx.Rngs, *,
                  route: Route = DEFAULT_ROUTE) -> nnx.Module:
  return LocalMixer(cfg, layer_pattern(cfg, layer), gated=True, route=route, rngs=rngs)


def make_sliding_window_mixer(cfg: ModelConfig, layer: int, rngs: nnx.Rngs, *,
                              route: Route = DEFAULT_ROUTE) -> nnx.Module:
  del layer
  return LocalMixer(cfg, Pattern.sliding(cfg.window), gated=False, route=route, rngs=rngs)


registry.register("pi_attention", registry.ModelEntry(make_mixer=make_pi_mixer,
                                                     logical_axes=LOGICAL_AXES))
registry.register("sliding_window", registry.ModelEntry(make_mixer=make_sliding_window_mixer))
