"""Gated DeltaNet (docs/architecture.md, "Gated DeltaNet"): the shared decoder with a gated
delta-rule recurrence as its mixer (`gated_deltanet_mixer.py`), its Mamba-2-style ablation, and
hybrids that make every k-th layer a sliding-window or π layer.

Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025.

- `model.delta_rule=False`: Mamba-2's gated linear recurrence S <- exp(g) S + k v^T (no beta).
- `model.hybrid_every=k`: layers k-1, 2k-1, ... are `model.hybrid_mixer` layers, the
  sliding-window or π mixer of `models/pi_attention.py` with its fields (`window`, `period`,
  `num_skips`, `period_schedule`, `gate`, `gate_hidden`: `families/gated_deltanet.py` declares
  them through `PiAttentionConfig`; the hybrid layers alone read them). The layers then differ:
  unrolled.
- `model.num_kv_heads`: the hybrid layers' grouped key/value heads; the recurrent layers keep
  `num_heads` heads for q, k and v (refused without hybrid layers).
- `model.recurrent_impl`: the op's state scan, 'auto' (the Pallas kernel on a TPU, `lax.scan`
  elsewhere), 'xla' or 'pallas'.
"""

from flax import nnx

from efficient_lm.config import axes
from efficient_lm.config.model import ModelConfig
from efficient_lm.families.gated_deltanet import is_hybrid
from efficient_lm.models import registry
from efficient_lm.models.gated_deltanet_mixer import GatedDeltaNet
from efficient_lm.models.pi_attention import make_pi_mixer, make_sliding_window_mixer
from efficient_lm.ops.route import DEFAULT as DEFAULT_ROUTE, Route

# Its parameters' own logical axes, and π's gate for a π hybrid (declared without jax).
LOGICAL_AXES = {**axes.FAMILY_AXES["gated_deltanet"], **axes.FAMILY_AXES["pi_attention"]}


def make_mixer(cfg: ModelConfig, layer: int, rngs: nnx.Rngs, *,
               route: Route = DEFAULT_ROUTE) -> nnx.Module:
  if is_hybrid(cfg, layer):
    make = make_pi_mixer if cfg.hybrid_mixer == "pi_attention" else make_sliding_window_mixer
    return make(cfg, layer, rngs, route=route)
  return GatedDeltaNet(cfg, route=route, rngs=rngs)


registry.register("gated_deltanet", registry.ModelEntry(make_mixer=make_mixer,
                                                      logical_axes=LOGICAL_AXES))
