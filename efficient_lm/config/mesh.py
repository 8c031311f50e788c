"""`MeshConfig`: the mesh section, typed: each field's default, meaning and check.

`config_base.base_config` reads the section's defaults from here and `--help` its docs;
`run.build` builds it from a config's mesh section (`MeshConfig.from_mapping`: a field the
section lacks takes its default here), which runs every check of the section alone. What needs
the devices or the other sections (the axes against the device count and the slices, the batch
and the sequence against the axes, the rules against the models' parameters) is checked in one
place, `sharding.validate` and the functions it calls (the batch and sequence against the axes
declared here: `MeshOnDevices`' rules). This module imports no jax.
"""

import dataclasses
import functools
from typing import Any

from efficient_lm.config import axes
from efficient_lm.config import fields as tc

AXES = ("data", "fsdp", "tensor", "context")
DCN_AXES = ("data", "fsdp")  # the axes that may also run across slices: `mesh.dcn_data`, `dcn_fsdp`
# Every logical axis name an activation may carry (`sharding.constrain`). `batch` and `length`
# are where the input batch is placed: the batch axes and `context`, not configurable.
ACTIVATION_AXES = ("batch", "length", "embed", "heads", "kv", "kv_heads", "mlp", "vocab")
FIXED_ACTIVATION_AXES = {"batch": ("data", "fsdp"), "length": ("context",)}


def _size(leaves: str, fix: str) -> tc.Check:
  return tc.Check(lambda v: isinstance(v, int) and not isinstance(v, bool) and (v >= 1 or v == -1),
                  f"must be a positive integer or -1 (the {leaves})", fix)


_DEVICES = _size("devices the other axes leave", "set {field}=1, or -1 on one axis")
_SLICES = _size("slices the other axis leaves",
                "set {field}=1, or -1 on one of mesh.dcn_data / dcn_fsdp")
_VALUE = tc.Check(lambda v: isinstance(v, str), "must be a string",
                  f"set {{field}} to a mesh axis ({', '.join(AXES)}) or '' (replicated)")
_AXIS_NAMES = tc.Check(lambda v: all(a in AXES for a in _names(v)),
                       "names an axis the mesh does not have",
                       f"use one of {', '.join(AXES)} or '' (replicated)")


def _free(cfg) -> list[str]:
  return [axis for axis in AXES if getattr(cfg, axis) == -1]


def _mapping(what: str) -> tc.Check:
  return tc.Check(lambda v: hasattr(v, "items"), f"must map {what} to mesh axes",
                  "set {field} as in efficient_lm/config/base.py's defaults")


def _names(value: str) -> tuple[str, ...]:
  return tuple(a.strip() for a in value.split(",") if a.strip() and a.strip().lower() != "none")


def axes_of(value: Any, field: str) -> tuple[str, ...]:
  """A rule's value as mesh axes: '' (or 'none', None) replicated, 'data,fsdp' two axes."""
  value = "" if value is None else value
  _VALUE(field, value)
  _AXIS_NAMES(field, value)
  return _names(value)


# Each rule's value: mesh axes ('' or None replicated), the same checks as `axes_of`'s.
_RULE_VALUES = tc.Each(lambda _, v: v is None or isinstance(v, str), _VALUE.requirement, _VALUE.fix)
_RULE_AXES = tc.Each(lambda _, v: _AXIS_NAMES.ok(v or ""), _AXIS_NAMES.requirement,
                     _AXIS_NAMES.fix)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig(tc.Section):
  """The mesh section: devices along each axis (exactly one may be -1: every device the others
  leave), the slices along the axes that cross slices, and the logical axis rules."""
  SECTION = "mesh"

  data: int = tc.setting(1, "devices along `data` (exactly one axis may be -1: every device the "
                         "others leave): batch split, parameters replicated (plain data "
                         "parallelism)", _DEVICES)
  fsdp: int = tc.setting(-1, "batch split and parameters / optimizer state sharded (FSDP)",
                         _DEVICES)
  tensor: int = tc.setting(1, "heads, MLP width and vocabulary split (tensor parallelism)",
                           _DEVICES)
  context: int = tc.setting(1, "the sequence split (context parallelism, ring ops)", _DEVICES)
  dcn_data: int = tc.setting(-1, "over several TPU slices: slices along `data` (gradients "
                             "all-reduced once a step); one of dcn_data / dcn_fsdp may be -1",
                             _SLICES)
  dcn_fsdp: int = tc.setting(1, "slices along `fsdp` (weights gathered across slices: costly)",
                             _SLICES)
  shard_optimizer_over_data: bool = tc.setting(
      False, "also split the optimizer state over `data` (ZeRO-1)", tc.boolean())
  max_replicated_fraction: float = tc.setting(
      0.05, "most of the parameters every device may hold whole (fsdp or tensor > 1); above it "
      "(and over 1M of them) a config error names them",
      tc.number_in(0.0, 1.0, fix="set mesh.max_replicated_fraction to e.g. 0.05"))
  rules: dict = tc.setting(
      doc="logical parameter axes -> mesh axes ('' = replicated; 'data,fsdp' = both): the "
      "decoder's and every model's own, at their defaults (efficient_lm/config/axes.py)",
      check=(_mapping("logical parameter axes"), _RULE_VALUES, _RULE_AXES,
             tc.Each(lambda name, value: name != "layers" or not _names(value or ""),
                     "must be '': the stacked layers of nnx.scan are never sharded",
                     "set mesh.rules.layers=''")),
      factory=lambda: axes.default_rules(axes.all_axes()))
  activation_rules: dict = tc.setting(
      doc="logical activation axes -> mesh axes (embed, heads, kv, kv_heads, mlp, vocab; the batch "
      "and sequence dimensions go where the batch is placed): see sharding.constrain",
      check=(_mapping("logical activation axes"),
             tc.Each(lambda name, _: name in ACTIVATION_AXES, "is not an activation axis",
                     f"use one of {', '.join(ACTIVATION_AXES[2:])}"),
             tc.Each(lambda name, _: name not in FIXED_ACTIVATION_AXES,
                     "is where the input batch is placed (the batch axes, `context`), not a rule",
                     "remove it: set mesh.data / mesh.fsdp / mesh.context instead"),
             _RULE_VALUES, _RULE_AXES),
      factory=axes.default_activation_rules)

  RULES = (
      tc.Rule("mesh.{last_free}", lambda c: len(_free(c)) <= 1,
              "is not the only axis at -1 ({free})", "keep -1 on one axis, e.g. set "
              "mesh.{last_free}=1", value=lambda c: -1,
              derive=lambda c: {"free": ", ".join("mesh." + a for a in _free(c)),
                                "last_free": _free(c)[-1] if _free(c) else ""}),
      tc.Rule("mesh.dcn_fsdp", lambda c: c.dcn_data != -1 or c.dcn_fsdp != -1,
              "and mesh.dcn_data=-1 cannot both take the rest",
              "set one of them to a number of slices"),
  )

  @functools.cached_property
  def rule_axes(self) -> dict[str, tuple[str, ...]]:
    """`rules` as {logical name: mesh axes}; a name the rules lack is replicated."""
    return {name: axes_of(value, f"mesh.rules.{name}") for name, value in self.rules.items()}

  @functools.cached_property
  def activation_axes(self) -> dict[str, tuple[str, ...]]:
    """`activation_rules` as {activation axis: mesh axes}, `batch` and `length` included."""
    out = dict(FIXED_ACTIVATION_AXES)
    for name in ACTIVATION_AXES[2:]:
      out[name] = axes_of(self.activation_rules.get(name, ""), f"mesh.activation_rules.{name}")
    return out

  def sizes(self) -> dict[str, int]:
    """{axis: `mesh.<axis>`} for the four axes (-1 still to be resolved against the devices)."""
    return {axis: getattr(self, axis) for axis in AXES}


def _batch_axes(p) -> dict:
  """The names `MeshOnDevices`' batch rule states: the split, and grad accumulation if any."""
  split, accum = p.sizes["data"] * p.sizes["fsdp"], p.grad_accum_steps
  more = accum > 1
  return {"split": split * accum, "data": p.sizes["data"], "fsdp": p.sizes["fsdp"],
          "times_accum": f" times train.grad_accum_steps={accum}" if more else "",
          "or_accum": " / train.grad_accum_steps" if more else ""}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshOnDevices(tc.Section):
  """The mesh's axis sizes on the job's devices (`sizes`, every -1 resolved) against the batch
  (`data.batch_size`, `train.grad_accum_steps`) and the sequence (`data.seq_len`): its rules
  declared, run as it is constructed (`sharding.validate`)."""
  SECTION = "mesh"
  sizes: dict
  seq_len: int
  batch_size: int
  grad_accum_steps: int = 1

  RULES = (
      tc.Rule("mesh.context", lambda p: p.seq_len % p.sizes["context"] == 0,
              "must divide data.seq_len={seq_len} (each device holds seq_len / context tokens)",
              "set mesh.context to a divisor of {seq_len} or data.seq_len to a multiple of "
              "{context}", value=lambda p: p.sizes["context"],
              derive=lambda p: {"context": p.sizes["context"]}),
      tc.Rule("data.batch_size", lambda p: p.batch_size % _batch_axes(p)["split"] == 0,
              "must be divisible by the mesh's batch axes (data={data} x fsdp={fsdp}){times_accum}",
              "set data.batch_size to a multiple of {split}, or lower mesh.data / mesh.fsdp"
              "{or_accum}", derive=_batch_axes),
  )


__all__ = ["ACTIVATION_AXES", "AXES", "DCN_AXES", "FIXED_ACTIVATION_AXES", "MeshConfig",
           "MeshOnDevices", "axes_of"]
