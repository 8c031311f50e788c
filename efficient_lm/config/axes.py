"""Every logical parameter axis: the name a parameter dimension carries, the config field that
sets its size, and the mesh axes it is split over by default (`mesh.rules`).

Nothing here imports jax: the config files read it (`config_base` fills `mesh.rules` from it), so a
mistake on the command line or in the config answers before jax starts. `sharding` places the
parameters by these names; a model family's own axes are declared here under its module's name
and named by its registry entry (`models.ModelEntry.logical_axes`); `models.logical_axes()` is the
union the registry uses, tested equal to `all_axes()`.
"""

from typing import Mapping, NamedTuple


class Axis(NamedTuple):
  """A logical parameter axis: the config field that sets its size (named in errors) and the mesh
  axes it is split over by default (`mesh.rules`; '' = replicated, 'data,fsdp' = both)."""
  size: str
  rule: str = ""


# The axes of the shared decoder's parameters.
SHARED_AXES = {
    "embed": Axis("model.d_model", "fsdp"),
    "mlp": Axis("model.mlp_ratio * model.d_model", "tensor"),
    "heads": Axis("model.num_heads", "tensor"),
    # Grouped-query attention's key/value heads (their own k/v projection): split like the
    # query heads, which needs mesh.tensor to divide them; '' replicates them instead.
    "kv_heads": Axis("model.num_kv_heads", "tensor"),
    "kv": Axis("model.d_model / model.num_heads"),
    "vocab": Axis("data.vocab_size", "tensor"),
    "positions": Axis("data.seq_len"),      # learned position embeddings
    "layers": Axis("model.num_layers"),     # the stacked layers of nnx.scan: never sharded
    "norm": Axis("model.d_model"),          # norm scales
    "qkv": Axis("3"),                       # the q/k/v (or k/v) index of fused projections
}

# Each family's own, by its module (`efficient_lm/models/<name>.py`).
FAMILY_AXES = {
    "bcmt": {
        "pool": Axis("1"),
        "memory": Axis("model.d_model", "fsdp"),
        "gate": Axis("model.d_model", "tensor"),
    },
    "perceiver_ar": {  # the learned compression map [history, compressed] and its group weights
        "history": Axis("model.seq_len - model.num_latents", "fsdp"),
        "compressed": Axis("(model.seq_len - model.num_latents) / model.compression"),
        "group": Axis("model.compression"),
    },
    "pi_attention": {"gate_hidden": Axis("model.gate_hidden")},  # the gate MLP's hidden width
    "gated_deltanet": {  # a value head's width, and the short convolution's taps
        "value": Axis("model.value_ratio * model.d_model / model.num_heads"),
        "conv": Axis("model.conv_size"),
    },
}


def all_axes() -> dict[str, Axis]:
  """The decoder's axes and every family's."""
  out = dict(SHARED_AXES)
  for family in FAMILY_AXES.values():
    out.update(family)
  return out


def default_rules(axes: Mapping[str, Axis] = SHARED_AXES) -> dict[str, str]:
  """`mesh.rules` at each axis's default (`embed` over `fsdp`; `mlp`, `heads` and `vocab` over
  `tensor`; a family's own axes as declared above)."""
  return {name: axis.rule for name, axis in axes.items()}


def default_activation_rules() -> dict[str, str]:
  """Activations split as the weights that produce them: `heads`, `mlp` and `vocab` over
  `tensor`; the residual stream's `embed` whole (its weights' `fsdp` shards are gathered)."""
  return {"embed": "", "heads": "tensor", "kv": "", "kv_heads": "tensor", "mlp": "tensor",
          "vocab": "tensor"}
