"""The config of Gated DeltaNet, its Mamba-2-style ablation and its hybrids: the recurrence's
fields, its rules and the hybrid layers' patterns (models/gated_deltanet.py builds its mixers).

It inherits π's fields (`window`, `period`, `num_skips`, ...) for the hybrid layers, from
families/pi_attention.py.
"""

import dataclasses

from efficient_lm.config import fields as tc
from efficient_lm.families.pi_attention import PiAttentionConfig, layer_pattern
from efficient_lm.ops.pattern import Pattern

RECURRENT_IMPLS = ("auto", "xla", "pallas")
HYBRID_MIXERS = ("sliding_window", "pi_attention")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedDeltaNetConfig(PiAttentionConfig):
  """Gated DeltaNet: the recurrence's fields; π's (inherited) set the hybrid layers."""
  conv_size: int = tc.setting(4, "taps of the short causal convolution on q, k and v (1: the "
                              "token alone)", tc.positive_int())
  chunk_size: int = tc.setting(64, "tokens per chunk of the gated delta rule's chunked form "
                               "([C, C] matmuls inside a chunk, a scan of the state across)",
                               tc.positive_int())
  value_ratio: int = tc.setting(2, "value head width = value_ratio * d_model / num_heads (the "
                                "key head width)", tc.positive_int())
  delta_rule: bool = tc.setting(True, "the delta rule's write; False: Mamba-2's gated linear "
                                "recurrence S <- exp(g) S + k v^T (the ablation)", tc.boolean())
  hybrid_every: int = tc.setting(0, "every hybrid_every-th layer is a model.hybrid_mixer layer "
                                 "(0: none)", tc.non_negative_int(
                                     fix="set model.hybrid_every to e.g. 4, or 0 (no hybrid)"))
  hybrid_mixer: str = tc.setting(
      "sliding_window", "the hybrid layers: 'sliding_window' (model.window) or 'pi_attention' "
      "(model.window, period, num_skips, gate)", tc.one_of(HYBRID_MIXERS, "is not a hybrid mixer"))
  recurrent_impl: str = tc.setting(
      "auto", "the recurrence's state scan: 'auto' (the Pallas kernel on TPU, xla elsewhere), "
      "'xla' (lax.scan), 'pallas' (TPU; elsewhere only with model.kernel_interpret)",
      tc.one_of(RECURRENT_IMPLS, "is not a recurrent backend"))

  RULES = (
      tc.Rule("model.hybrid_every", lambda c: c.hybrid_every != 1,
              "would make every layer a {hybrid_mixer} layer (no gated delta layer is left)",
              "set model.hybrid_every to 0 (none) or at least 2, or use "
              "model.name='{hybrid_mixer}'"),
      tc.Rule("model.hybrid_every", lambda c: c.hybrid_every <= c.num_layers,
              "leaves no {hybrid_mixer} layer among model.num_layers={num_layers}",
              "set model.hybrid_every to at most {num_layers}, or 0 (no hybrid)"),
      # The recurrent layers keep num_heads heads for q, k and v (a [K, V] state per head):
      # grouped key/value heads are the hybrid attention layers' only.
      tc.Rule("model.num_kv_heads", lambda c: c.hybrid_every or c.kv_heads == c.num_heads,
              "groups attention's key/value heads, and without model.hybrid_every this model has "
              "no attention layer (its recurrent layers keep model.num_heads={num_heads} heads)",
              "set model.num_kv_heads to 0, or model.hybrid_every to e.g. 4 (the hybrid layers "
              "take it)"),
  )
  # Decided by where it runs (`models/placement.py`): the kernel needs its TPU.
  PLACEMENT_RULES = (
      tc.Rule("model.recurrent_impl",
              lambda p: (p.platform in (None, "tpu") or p.model.recurrent_impl != "pallas"
                         or p.model.kernel_interpret),
              "runs the gated delta rule's state scan as a TPU (Mosaic) kernel, and this "
              "platform is {platform!r}",
              "set model.recurrent_impl='auto' (or 'xla'), or model.kernel_interpret=True "
              "(Pallas interpret mode: slow, for tests)", value=lambda p: p.model.recurrent_impl),
  )

  def patterns(self, seq_len: int | None = None) -> tuple[Pattern, ...]:
    """The hybrid layers' patterns (the recurrent layers have none)."""
    del seq_len  # the same at any length
    found = []
    for layer in range(self.num_layers):
      pattern = hybrid_pattern(self, layer)
      if pattern is not None and pattern not in found:
        found.append(pattern)
    return tuple(found)

  def layer_patterns(self, seq_len: int | None = None) -> tuple[Pattern | None, ...]:
    """The hybrid layers' patterns in place, None for each recurrent layer."""
    del seq_len
    return tuple(hybrid_pattern(self, layer) for layer in range(self.num_layers))

  def recurrence_flops(self, seq_len: int) -> float:
    """A recurrent layer's gated delta rule (or, without the delta rule, its gated linear
    recurrence) over seq_len tokens: `train_flops_per_token` per token and head, in chunks of
    min(chunk_size, seq_len)."""
    K = self.d_model // self.num_heads
    per_token = train_flops_per_token(K, self.value_ratio * K, min(self.chunk_size, seq_len),
                                      self.delta_rule)
    return seq_len * self.num_heads * per_token

  @property
  def identical_layers(self) -> bool:
    return not self.hybrid_every

  def input_limit(self) -> tuple[int | None, str]:
    """Any length (learned positions aside): the recurrent layers carry a state of fixed size,
    [K, V] per head, and the hybrid layers' attention has bounded reach."""
    most, rule = super().input_limit()
    if most is not None:  # learned positions: the table's limit
      return most, rule
    hybrid = (f"; its model.hybrid_mixer={self.hybrid_mixer!r} layers attend within a bounded "
              "reach (RoPE)") if self.hybrid_every else ""
    return None, (f"model.name={self.name!r} carries a fixed-size state from token to token (a "
                  f"[K, V] matrix per head){hybrid}: any length")


def train_flops_per_token(key_dim: int, value_dim: int, chunk: int, delta: bool = True) -> float:
  """Model FLOPs of the recurrence's chunked form (ops/recurrent/chunked.py) per token and head,
  forward and backward (2 per multiply-add, the backward twice the forward: 6 x the forward's
  multiply-adds), its matmuls as it runs them in chunks of `chunk` tokens (C), with keys of K and
  values of V. Per chunk: Q K^T and its product with U (C^2 (K + V)), Q S_0 and the state's
  update Kd^T U (2 C K V); with the delta rule also K K^T (C^2 K), (I + L)^-1 by doubling
  (C (C^2 - 1) / 3), its product with [beta V, beta gamma K] (C^2 (V + K)) and W S_0 (C K V).
  Neither the elementwise decays nor the rematerialisation's recomputation are counted (model
  FLOPs, as `efficient_lm.training.flops` counts attention's)."""
  C, K, V = chunk, key_dim, value_dim
  per_chunk = C * C * (K + V) + 2 * C * K * V
  if delta:
    per_chunk += C * C * K + C * (C * C - 1) / 3 + C * C * (V + K) + C * K * V
  return 6 * per_chunk / C


def is_hybrid(cfg: GatedDeltaNetConfig, layer: int) -> bool:
  """Whether `layer` is a `hybrid_mixer` layer: every hybrid_every-th, counting from 1."""
  return bool(cfg.hybrid_every) and (layer + 1) % cfg.hybrid_every == 0


def hybrid_pattern(cfg: GatedDeltaNetConfig, layer: int) -> Pattern | None:
  """The attention pattern of `layer`, None for a recurrent layer."""
  if not is_hybrid(cfg, layer):
    return None
  if cfg.hybrid_mixer == "pi_attention":
    return layer_pattern(cfg, layer)
  return Pattern.sliding(cfg.window)


MODELS = {
    "gated_deltanet": (GatedDeltaNetConfig, "gated_deltanet",
                       "Gated DeltaNet: a gated delta-rule recurrence, a [K, V] state per head (no "
                       "attention)"),
}

__all__ = ["GatedDeltaNetConfig", "MODELS", "HYBRID_MIXERS", "RECURRENT_IMPLS", "hybrid_pattern",
           "is_hybrid", "train_flops_per_token"]
