"""`ModelPlacement`: a typed model config where it runs, with the rules that join them declared.

Where it runs is the platform (`attention_impl` must run there: its backend, its installed
kernels, the model's attention patterns) and the devices along the sequence (`mesh.context`: the
family must have a ring, its attention block may not straddle devices, a zig-zag layout needs
two half-chunks per device). Constructing one runs every rule in order (`RULES`); each failure is
one `ConfigError` naming the field, the value and the fix, before anything compiles.
"""

import dataclasses

from efficient_lm.config import fields as tc
from efficient_lm.config.model import ModelConfig
from efficient_lm.models.registry import REGISTRY
from efficient_lm.ops.core import backends


def _backend_rule(reason, requirement: str, fix: str) -> tc.Rule:
  """`model.attention_impl` against the platform: `reason(placement)` says why it cannot run."""
  return tc.Rule("model.attention_impl", lambda p: reason(p) is None, requirement, fix,
                 when=lambda p: p.platform is not None,
                 derive=lambda p: {"reason": reason(p)}, value=lambda p: p.model.attention_impl)


def _ring_rule(ok, requirement: str, fix: str, when=None) -> tc.Rule:
  """`mesh.context > 1` against the model (with `when`: only where it holds too)."""
  return tc.Rule("mesh.context", ok, requirement, fix, value=lambda p: p.context,
                 when=lambda p: p.context > 1 and (when is None or when(p)),
                 derive=lambda p: {"chunk": p.model.seq_len // p.context, "double": 2 * p.context,
                                   "why": REGISTRY[p.model.name].no_context_parallel,
                                   "parallel": ", ".join(sorted(
                                       n for n, e in REGISTRY.items() if e.context_parallel))})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelPlacement(tc.Section):
  """A model config on `platform` (None: not checked against one) with `context` devices along
  the sequence."""
  SECTION = "model"
  model: ModelConfig
  platform: str | None = None
  context: int = 1

  RULES = (
      _backend_rule(lambda p: backends.check(p.model.attention_impl, p.platform,
                                             p.model.kernel_interpret),
                    "cannot run here: {reason}", "see above"),
      _backend_rule(lambda p: backends.check_installed(p.model.attention_impl, p.platform),
                    "cannot call its kernels on this jax, so every attention call would run on "
                    "xla: {reason}", "set model.attention_impl='xla' (or 'auto'), or install a jax "
                    "in jax_compat.JAX_REQUIREMENT"),
      _backend_rule(lambda p: backends.check_patterns(p.model.attention_impl, p.platform,
                                                      list(p.model.patterns())),
                    "cannot express {model.name}'s attention: {reason}",
                    "set model.attention_impl accordingly"),
      tc.Rule("model.seq_chunk", lambda p: not p.model.seq_chunk or (
          p.model.seq_chunk >= p.model.seq_len),
              "is not combined with mesh.context={context} (the ring ops already split the "
              "sequence over devices)", "set model.seq_chunk=0, or mesh.context=1",
              when=lambda p: p.context > 1, value=lambda p: p.model.seq_chunk),
      _ring_rule(lambda p: REGISTRY[p.model.name].context_parallel,
                 "> 1 is not supported for model.name={model.name!r} ({why})",
                 "set mesh.context=1 (and use mesh.data for more devices), or use one of "
                 "{parallel}"),
      _ring_rule(lambda p: (p.model.seq_len // p.context) % p.model.context_block == 0,
                 "leaves {chunk} tokens per device, not a multiple of {model.name}'s attention "
                 "block of {model.context_block} tokens (blocks may not straddle devices)",
                 "choose mesh.context so that data.seq_len / mesh.context is a multiple of "
                 "{model.context_block}"),
      _ring_rule(lambda p: p.model.seq_len % (2 * p.context) == 0,
                 "needs data.seq_len={model.seq_len} divisible by 2 * mesh.context (the zig-zag "
                 "layout gives each device two half-chunks)",
                 "set data.seq_len to a multiple of {double}",
                 when=lambda p: p.model.ring_layout == "zigzag"),
  )

  def check(self) -> None:
    """`RULES`, then the family's own placement rules (its config class's `PLACEMENT_RULES`,
    rules over this placement: e.g. a kernel of its own that needs its platform)."""
    super().check()
    for rule in getattr(type(self.model), "PLACEMENT_RULES", ()):
      rule(self)


def check(cfg: ModelConfig, platform: str | None = None, context: int = 1) -> ModelPlacement:
  """Every rule of `cfg` on `platform` with `context` devices along the sequence; raises
  ConfigError."""
  return ModelPlacement(model=cfg, platform=platform, context=context)


def validate_attention_impl(cfg: ModelConfig, platform: str) -> None:
  """`model.attention_impl` (and `kernel_interpret`) against the platform and the model's
  patterns."""
  check(cfg, platform)


def validate_context(cfg: ModelConfig, context: int) -> None:
  """The model against `context` devices along the sequence (`mesh.context`)."""
  check(cfg, None, context)


__all__ = ["ModelPlacement", "check", "validate_attention_impl", "validate_context"]
