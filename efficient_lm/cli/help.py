"""`--help` and `--help=<model>`: a command's flags, the models, and every config field with its
default and its meaning, generated from where each is declared so the listing cannot drift.

The fields are the keys of the real ConfigDicts (`config_base.base_config` and each shipped
`configs/<family>.py`'s `get_config()`); a field's meaning is the one-line doc its typed section
declares (`DataConfig`, `TrainConfig`, `MeshConfig`; the model's: its family's config class in
`efficient_lm.families`, the shared `ModelConfig` fields included), and the rules across fields
are the ones that run (each class's `all_rules()`). A `mesh.rules` entry is described by its axis
in `config/axes.py`. The model list (`MODELS`) is each family's own declaration
(`families.LISTINGS`), which `models.REGISTRY` takes too. Nothing here imports jax (the families'
declarations load none), so `--help` answers in a fraction of a second.
"""

import os
import shutil
import sys
import textwrap

import ml_collections
from absl import flags

from efficient_lm import families
from efficient_lm.config import axes
from efficient_lm.config import base as config_base
from efficient_lm.config import data as data_config
from efficient_lm.config import files as config_files
from efficient_lm.config import mesh as mesh_config
from efficient_lm.config import model as model_config
from efficient_lm.config import train as train_config
from efficient_lm.runtime import exit_codes

SECTIONS = ("data", "model", "train", "mesh")
HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "-helpshort", "-helpfull")

# Maps whose entries are set from axes.py rather than one by one: their entries' meaning.
_MAPS = {"mesh.rules": "mesh axes of the parameter axis `{key}` (size {size})",
         "mesh.activation_rules": "mesh axes of the activation axis `{key}`"}
TYPED = {"data": data_config.DataConfig, "model": model_config.ModelConfig,
         "train": train_config.TrainConfig, "mesh": mesh_config.MeshConfig}  # declared sections


class _Shown(str):
  """A default shown as written, not as a repr."""

  def __repr__(self) -> str:
    return str(self)


class HelpError(ValueError):
  """`--help=<name>` that names no model."""


def leaves(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, object]:
  """Every field of `config` ('data.seq_len': 256, 'mesh.rules.embed': 'fsdp', ...), in order."""
  out = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      out.update(leaves(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def _typed_docs(cls) -> dict[str, tuple[str, str]]:
  """{field: (type, doc)} of a typed section's class."""
  types = {f.name: getattr(f.type, "__name__", str(f.type)) for f in cls.declared().values()}
  return {k: (types[k], doc) for k, doc in cls.docs().items()}


def listed_models() -> dict[str, tuple[str, str]]:
  """model name -> (the `--config=` that trains it, one line): each family's own declaration
  (`families.LISTINGS`), in the order of the family modules."""
  return dict(families.LISTINGS)


def declared_meanings(model: str) -> dict[str, str]:
  """'section.field' -> '(type) doc' of every declared field, in declaration order: the four
  sections', the model section's from `model`'s family class (its shared fields first)."""
  out = {}
  for section, cls in TYPED.items():
    cls = families.CLASSES.get(model, cls) if section == "model" else cls
    out.update({f"{section}.{k}": f"({t}) {doc}" for k, (t, doc) in _typed_docs(cls).items()})
  return out


def meanings(spec: str | None = None,
             config: ml_collections.ConfigDict | None = None) -> dict[str, str]:
  """Every field of `spec`'s config (a `--config=` form, or `config` if given, loaded from it;
  None: `base_config`) -> its one-line meaning, its declaration's ('' for a field nothing
  declares), in declaration order."""
  if config is None:
    config = config_base.base_config("dense") if spec is None else config_files.load_config(spec)
  declared = declared_meanings(config.model.name)
  parameter_axes = axes.all_axes()
  order = {field: i for i, field in enumerate(declared)}
  out = {}
  for field in sorted(leaves(config), key=lambda f: (order.get(f, order.get(f.rpartition(".")[0],
                                                                            len(order))), f)):
    parent, _, key = field.rpartition(".")
    if parent in _MAPS:
      size = parameter_axes[key].size if key in parameter_axes else "?"
      out[field] = _MAPS[parent].format(key=key, size=size)
    else:
      out[field] = declared.get(field, "")
  return out


def _rows(fields: dict[str, object], meaning: dict[str, str], width: int) -> list[str]:
  """'  name = default   meaning' lines, the meaning wrapped under itself."""
  column = 40
  lines = []
  for field, value in fields.items():
    head = f"  {field} = {value!r}"
    text = meaning.get(field, "")
    if len(head) + 2 > column:
      lines.append(head)
      head = ""
    lines += textwrap.wrap(text, width=max(width, column + 30), initial_indent=head.ljust(column),
                           subsequent_indent=" " * column) or [head]
  return lines


def _flag_lines(width: int) -> list[str]:
  """The flags this command defines (not absl's own)."""
  lines = []
  for module, defined in sorted(flags.FLAGS.flags_by_module_dict().items()):
    if module.startswith("absl"):
      continue
    for flag in sorted(defined, key=lambda f: f.name):
      default = "" if flag.default is None else f" (default: {flag.default!r})"
      if flags.FLAGS[flag.name].validators and flag.default is None:
        default = " (required)"
      lines += textwrap.wrap(f"{flag.help}{default}", width=max(width, 70),
                             initial_indent=f"  --{flag.name}".ljust(26),
                             subsequent_indent=" " * 26)
  return lines


def _command_line() -> str:
  """The running command's usage: its module docstring's first line."""
  for module in flags.FLAGS.flags_by_module_dict():  # (`python -m`: the script's path)
    doc = getattr(sys.modules.get(module, sys.modules["__main__"]), "__doc__", None)
    if not module.startswith("absl") and doc:
      lines = doc.strip().splitlines()
      example = [line for line in lines[1:] if line.strip().startswith("python -m")][:1]
      return "\n".join([lines[0], *example])
  return ""


def __getattr__(name: str):
  if name == "MODELS":  # read on first use: importing this module parses nothing
    return listed_models()
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def listing(width: int | None = None) -> str:
  """What `--help` prints: the command's flags, the models, and every field of every shipped
  config: the shared ones by section, then what each family's file adds (and changes)."""
  width = width or min(120, shutil.get_terminal_size((100, 20)).columns)
  out = [_command_line(), "", "Flags:",
         "  --help[=<model>]".ljust(26) + "this listing; with a model's name, the fields it reads",
         *_flag_lines(width), "",
         "Models (model.name; `--help=<model>` lists the fields it reads):"]
  models = listed_models()
  name_width = max(map(len, models))
  spec_width = max(len(spec) for spec, _ in models.values()) + len("--config=")
  for name, (spec, line) in models.items():  # one line each, whatever the width
    out.append(f"  {name:<{name_width}}  {'--config=' + spec:<{spec_width}}  {line}")
  out += ["", "Config fields (override any with --config.<field>=<value>; the default, then what "
          "it is):"]
  values = leaves(config_base.base_config("dense"))
  values["model.name"] = _Shown("<the model's; set by its config>")
  meaning = meanings()
  fields = {k: values[k] for k in meaning}  # in the order config/base.py defines them
  for section in SECTIONS:
    out += ["", f"{section}. ({'shared by every model' if section == 'model' else 'every model'})"]
    out += _rows({k: v for k, v in fields.items() if k.split(".")[0] == section}, meaning, width)
  rules = [r.describe() for cls in (data_config.DataConfig, model_config.ModelConfig,
                                    mesh_config.MeshConfig) for r in cls.all_rules()]
  out += ["", "Rules across fields (checked before anything runs; {field} is its value; a family's "
          "own: --help=<model>):"]
  out += textwrap.wrap("; ".join(rules), width=max(width, 70), initial_indent="  ",
                       subsequent_indent="  ")
  extra = sorted(set(k.split(".")[0] for k in fields) - set(SECTIONS))
  for section in extra:  # a section added to config_base later is listed too
    out += ["", f"{section}."]
    out += _rows({k: v for k, v in fields.items() if k.split(".")[0] == section}, meaning, width)
  for family in config_files.config_names():
    config = config_files.load_config(family)
    own, changed = family_fields(family, config)
    models = ", ".join(m for m, (spec, _) in listed_models().items()
                       if spec.partition(":")[0] == family)
    out += ["", f"configs/{family}.py ({models or 'no model'}): "
            + ("adds" if own else "adds no field") + (":" if own else "")]
    meaning = meanings(family, config)
    out += _rows({k: own[k] for k in meaning if k in own}, meaning, width)
    if changed:
      out += textwrap.wrap("changes the defaults: " + ", ".join(f"{k}={v!r}"
                                                                 for k, v in changed.items()),
                           width=max(width, 70), initial_indent="  ", subsequent_indent="    ")
  return "\n".join(out) + "\n"


def family_fields(family: str, config: ml_collections.ConfigDict | None = None,
                  ) -> tuple[dict[str, object], dict[str, object]]:
  """The fields `configs/<family>.py` adds to `base_config` (with its defaults), and the shared
  fields it gives other defaults."""
  config = config if config is not None else config_files.load_config(family)
  base = leaves(config_base.base_config(config.model.name))
  fields = leaves(config)
  own = {k: v for k, v in fields.items() if k not in base}
  changed = {k: v for k, v in fields.items() if k in base and base[k] != v}
  return own, changed


def model_listing(model: str, width: int | None = None) -> str:
  """What `--help=<model>` prints: every field the model reads, at its config's defaults: the
  shared ones by section, then its own."""
  if model not in listed_models():
    raise HelpError(f"--help={model}: there is no model {model!r}; use one of "
                    f"{', '.join(listed_models())} (or --help for everything)")
  width = width or min(120, shutil.get_terminal_size((100, 20)).columns)
  spec, line = listed_models()[model]
  config = config_files.load_config(spec)
  meaning = meanings(spec, config)
  own, changed = family_fields(spec.partition(":")[0], config)
  values = leaves(config)
  fields = {k: values[k] for k in meaning if k not in own}
  own = {k: values[k] for k in meaning if k in own}
  out = [f"{model}: {line}", f"Trained with --config={spec}; every field it reads, at that "
         "config's defaults (override any with --config.<field>=<value>):"]
  for section in dict.fromkeys([*SECTIONS, *(k.split(".")[0] for k in fields)]):
    rows = {k: v for k, v in fields.items() if k.split(".")[0] == section}
    if rows:
      out += ["", f"{section}." + (" (shared by every model)" if section == "model" else "")]
      out += _rows(rows, meaning, width)
  out += ["", f"{model}'s own (configs/{spec.partition(':')[0]}.py):"]
  out += _rows(own, meaning, width) if own else ["  none"]
  stated = [r.describe() for r in families.CLASSES[model].all_rules()]
  out += ["", "Rules across its fields (checked before anything runs; {field} is its value):"]
  out += textwrap.wrap("; ".join(stated), width=max(width, 70), initial_indent="  ",
                       subsequent_indent="  ")
  if changed:
    out += ["", textwrap.fill("Set for it by its config (the shared default otherwise): "
                              + ", ".join(changed), width=max(width, 70))]
  return "\n".join(out) + "\n"


def requested(argv: list[str]) -> str | None:
  """'' for `--help` (or -h, --helpfull, ...), the name for `--help=<name>`, None without either;
  nothing after `--` counts."""
  for arg in argv[1:]:
    if arg == "--":
      return None
    if arg in HELP_FLAGS:
      return ""
    for flag in ("--help=", "-help="):
      if arg.startswith(flag):
        return arg[len(flag):]
  return None


def answer(argv: list[str]) -> None:
  """Prints `--help`'s or `--help=<model>`'s listing and exits 0 when `argv` asks for one (an
  unknown model: one `error:` line, status 2); returns otherwise."""
  name = requested(argv)
  if name is None:
    return
  try:
    text = model_listing(name) if name else listing()
  except HelpError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(exit_codes.USAGE)
  try:
    sys.stdout.write(text)
    sys.stdout.flush()
  except BrokenPipeError:  # `--help | head`: the reader has what it wanted
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  sys.exit(0)


__all__ = ["MODELS", "HelpError", "answer", "declared_meanings", "family_fields", "leaves",
           "listing", "meanings", "model_listing", "requested"]
