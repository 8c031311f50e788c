"""`ModelConfig`: the fields every model shares, typed, each with its default, meaning and check.

Each family subclasses it in `efficient_lm/families/` (`families/pi_attention.py`'s
`PiAttentionConfig`, ...), declares its own fields and states `patterns(seq_len)`: the attention
patterns the model trains with, without building it. What the library derives from those
patterns (whether the blocks run over sequence chunks, the block a device's share of the sequence
must be a multiple of, the ring's sequence layout) is a method here. `config_base.base_config`
reads the model section's defaults from this class; `run.build` builds the family's typed object
from a config's model section. This module imports no jax (`--help` and `config_base` read it).
"""

import dataclasses
import math

from efficient_lm.config import fields as tc

POSITIONS = ("rope", "learned")
DTYPES = ("float32", "bfloat16")
REMATS = ("none", "block", "dots")  # 'none' and `decoder.REMAT_POLICIES` (tested equal)
# `ops.core.backends.IMPLS` and its earlier names (`ALIASES`), tested equal (ops imports jax).
ATTENTION_IMPLS = ("auto", "xla", "splash", "gpu", "reference")
ATTENTION_ALIASES = ("flash", "cudnn")


def _head_dim(cfg) -> dict:
  return {"head_dim": cfg.d_model // cfg.num_heads}


def _kv_heads_fix(cfg) -> dict:
  divisors = [d for d in range(1, cfg.num_heads + 1) if cfg.num_heads % d == 0]
  return {"divisors": ", ".join(map(str, divisors))}


SHARED_RULES = (
    tc.Rule("model.d_model", lambda c: c.d_model % c.num_heads == 0,
            "must be divisible by model.num_heads={num_heads}",
            "set model.d_model to a multiple of {num_heads} or change model.num_heads"),
    tc.Rule("model.d_model", lambda c: c.position != "rope" or c.d_model // c.num_heads % 2 == 0,
            "gives an odd head width {head_dim}, which RoPE cannot rotate",
            "make model.d_model / model.num_heads even", derive=_head_dim),
    tc.Rule("model.num_kv_heads", lambda c: c.num_kv_heads == 0 or c.num_heads % c.num_kv_heads == 0,
            "must divide model.num_heads={num_heads} (grouped-query attention)",
            "set model.num_kv_heads to one of {divisors} (1: multi-query), or 0 (as many as "
            "model.num_heads)", derive=_kv_heads_fix),
)
_CHUNKED = lambda c: bool(c.seq_chunk) and c.seq_chunk < c.seq_len  # noqa: E731
SEQ_CHUNK_RULES = (  # (a chunk shorter than the window)
    tc.Rule("model.seq_chunk", lambda c: c.chunkable,
            "is not supported for model.name={name!r}: its queries see the whole window, so its "
            "blocks cannot run over chunks of it",
            "set model.seq_chunk=0 (model.remat and train.loss_chunk still cut its memory)",
            when=_CHUNKED),
    tc.Rule("model.seq_chunk", lambda c: c.seq_len % c.seq_chunk == 0,
            "must divide data.seq_len={seq_len}", "set model.seq_chunk to a divisor of {seq_len}",
            when=_CHUNKED),
    tc.Rule("model.seq_chunk", lambda c: c.seq_chunk % c.context_block == 0,
            "is not a multiple of {name}'s attention block of {block} tokens (a chunk holds whole "
            "blocks)", "set model.seq_chunk to a multiple of {block}", when=_CHUNKED,
            derive=lambda c: {"block": c.context_block}),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(tc.Section):
  """The model section's shared fields; a family's subclass adds its own."""
  SECTION = "model"

  name: str = tc.setting(doc="registry key in efficient_lm.models.REGISTRY (set by the config)")
  vocab_size: int = tc.setting(doc="always the tokenizer's size (a reference to data.vocab_size)",
                               check=tc.positive_int())
  seq_len: int = tc.setting(doc="always the data's window (a reference to data.seq_len)",
                            check=tc.positive_int())
  d_model: int = tc.setting(256, "residual stream width", tc.positive_int())
  num_layers: int = tc.setting(4, "decoder blocks", tc.positive_int())
  num_heads: int = tc.setting(4, "attention heads; d_model / num_heads is the head width",
                              tc.positive_int())
  num_kv_heads: int = tc.setting(
      0, "key/value heads (grouped-query attention: each serves num_heads / num_kv_heads query "
      "heads, the decoding cache and the k/v projections shrink by that factor); a divisor of "
      "num_heads, 1 = multi-query; 0 = num_heads (multi-head)",
      tc.non_negative_int("must be an integer >= 0 (0 = model.num_heads)",
                          "set model.num_kv_heads to a divisor of model.num_heads (1: multi-query), "
                          "or 0 (as many as model.num_heads)"))
  mlp_ratio: int = tc.setting(4, "MLP hidden width = mlp_ratio * d_model", tc.positive_int())
  dropout: float = tc.setting(0.0, "dropout on embeddings and residual branches",
                              tc.number_in(0.0, 1.0, high_open=True,
                                           fix="set model.dropout to e.g. 0.0 or 0.1"))
  position: str = tc.setting("rope", "'rope' or 'learned' absolute positions",
                             tc.one_of(POSITIONS, "is not a known position encoding",
                                       "use 'rope' or 'learned'"))
  rope_base: float = tc.setting(10000.0, "RoPE frequency base",
                                tc.number_in(0.0, math.inf, low_open=True, high_open=True,
                                             requirement="must be a positive number",
                                             fix="set model.rope_base to e.g. 10000.0"))
  tie_embeddings: bool = tc.setting(True, "output head shares the token embedding", tc.boolean())
  dtype: str = tc.setting("float32", "compute dtype: float32 on CPU, bfloat16 on accelerators "
                          "(parameters, residual stream, softmax and loss stay float32)",
                          tc.one_of(DTYPES, "is not a supported compute dtype",
                                    "use 'float32' (CPU) or 'bfloat16' (accelerators)"))
  remat: str = tc.setting("none", "rematerialize each block in the backward pass: 'none', "
                          "'block' (keep only block inputs), 'dots' (also matmul outputs)",
                          tc.one_of(REMATS, "is not a rematerialization policy",
                                    "use 'none', 'block' (keep only block inputs) or 'dots' "
                                    "(also keep matmul outputs)"))
  seq_chunk: int = tc.setting(
      0, "run each block's position-wise parts (norms, projections, queries, MLP) over chunks of "
      "this many tokens (0 = all at once); models of bounded reach only (not dense, not "
      "Perceiver-AR); a divisor of seq_len and a multiple of the block / segment",
      tc.non_negative_int("must be an integer >= 0 (0 = the whole window at once)",
                          "set model.seq_chunk to e.g. 8192, or 0"))
  attention_impl: str = tc.setting(
      "auto", "the attention backend, every model: 'auto' (per platform: splash on TPU, gpu on "
      "GPU, xla elsewhere), 'xla' (the blockwise core, O(T) memory; 'flash' is its earlier "
      "name), 'splash' (TPU Pallas kernels), 'gpu' (cuDNN + a Pallas kernel; 'cudnn' is its "
      "earlier name), 'reference' (dense [T, T] masked softmax: tests)",
      tc.one_of((*ATTENTION_IMPLS, *ATTENTION_ALIASES), "is not a known attention backend",
                f"use one of {', '.join(ATTENTION_IMPLS)}"))  # and per platform: the registry
  kernel_interpret: bool = tc.setting(
      False, "run a kernel backend off its hardware in Pallas interpret mode (slow: tests); "
      "otherwise a kernel needs its TPU / GPU",
      tc.boolean("set model.kernel_interpret=False (True runs a kernel in Pallas interpret mode: "
                 "tests)"))

  @classmethod
  def all_rules(cls) -> tuple[tc.Rule, ...]:
    """The shared rules, the family's own (`RULES`: they run before anything reads its
    patterns), then the sequence chunks' (which read the patterns)."""
    return (*SHARED_RULES, *cls.RULES, *SEQ_CHUNK_RULES)

  @property
  def kv_heads(self) -> int:
    """The key/value heads: `num_kv_heads`, or `num_heads` when it is 0 (the default)."""
    return self.num_kv_heads or self.num_heads

  # What the library derives from the patterns.

  def patterns(self, seq_len: int | None = None) -> tuple:
    """Every distinct attention pattern (`ops.pattern.Pattern`) the model trains with at
    `seq_len` (default: `model.seq_len`), without building it; the family states it."""
    raise NotImplementedError(f"{type(self).__name__} must state patterns(seq_len)")

  def layer_patterns(self, seq_len: int | None = None) -> tuple:
    """Each layer's attention pattern, in order: None for a layer that mixes without attention
    (a recurrence, whose cost `recurrence_flops` states). By default `patterns()` in order, the
    last one for the layers past them; a family whose layers differ otherwise states it."""
    found = self.patterns(seq_len)
    if not found:
      return (None,) * self.num_layers
    return tuple(found[min(layer, len(found) - 1)] for layer in range(self.num_layers))

  @property
  def flops_counted(self) -> bool:
    """Whether `efficient_lm.training.flops` can count this model's FLOPs from its patterns:
    every layer runs every position of the sequence through its parameters (not so where layers
    keep fewer positions, as the Perceiver-AR family's latents)."""
    return True

  def recurrence_flops(self, seq_len: int) -> float:
    """Model FLOPs, forward and backward, of one layer without attention (a None of
    `layer_patterns`) over a sequence of `seq_len` tokens, beyond its parameters' (counted apart:
    `efficient_lm.training.flops`); 0 for a family without such layers."""
    del seq_len
    return 0.0

  @property
  def chunkable(self) -> bool:
    """Whether the blocks can run over sequence chunks: every pattern's reach is bounded."""
    return all(p.reach is not None for p in self.patterns())

  def input_limit(self) -> tuple[int | None, str]:
    """(the most tokens one input of the trained model may hold, or None for any length; the rule
    in words), what `evaluation.long_context.reach` checks a length against: learned positions
    have a table of model.seq_len; with RoPE any length goes (every pattern of bounded reach:
    each token sees what it saw in training; dense: out of distribution past seq_len). A family
    whose architecture fixes its window states its own limit beside its fields."""
    if self.position == "learned":
      return self.seq_len, (f"model.position='learned' has a table of model.seq_len="
                            f"{self.seq_len} positions and none past it")
    if self.chunkable:
      return None, f"model.name={self.name!r} has attention of bounded reach (RoPE): any length"
    return None, f"model.name={self.name!r} attends to every earlier position (RoPE): any length"

  @property
  def context_block(self) -> int:
    """What each device's (or sequence chunk's) share of the sequence must be a multiple of: the
    patterns' blocks (BCMT's block, ECP's piece), 1 without blocks."""
    return math.lcm(1, *(p.block_size for p in self.patterns() if p.block_size))

  @property
  def ring_layout(self) -> str:
    """The sequence order a sharded sequence arrives in: 'zigzag' when dense causal attention
    runs as ring attention (its work balanced), else 'natural' (halos)."""
    return "natural" if self.chunkable else "zigzag"

  @property
  def identical_layers(self) -> bool:
    """Whether every layer is the same (then scanned); a family whose layers differ says so."""
    return True


__all__ = ["ATTENTION_ALIASES", "ATTENTION_IMPLS", "DTYPES", "ModelConfig", "POSITIONS", "REMATS",
           "SEQ_CHUNK_RULES", "SHARED_RULES"]
