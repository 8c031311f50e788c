"""`--help` and `--help=<model>`: a command's flags, the models, and every config field with its
default and its meaning, generated from where each is defined so the listing cannot drift.

The fields are the keys of the real ConfigDicts (`config_base.base_config` and each shipped
`configs/<family>.py`'s `get_config()`); a field's meaning is the one-line doc a typed section
declares (`model_config.ModelConfig`: the shared model fields, a family's config class in
`models/`, read from its source; `data_config.DataConfig`, `train_config.TrainConfig`,
`mesh_config.MeshConfig`), else the comment beside its
definition in config/base.py or the family's file (read with `ast` and `tokenize`: the comment
after the assignment with its continuation lines, indented further, joined; or, for an
assignment with none, the comment lines just above it). A `mesh.rules` entry is described by its axis in `config/axes.py`. The
model list (`MODELS`) is each family's own `listing`, read from its `register(...)` call in
`models/` with `ast`, and tested equal to `models.REGISTRY`'s (which imports jax: this module does
not, so `--help` answers in a fraction of a second).
"""

import ast
import functools
import io
import os
import re
import shutil
import sys
import textwrap
import tokenize

import ml_collections
from absl import flags

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


def _attribute_path(node: ast.AST, aliases: dict[str, str]) -> str | None:
  """`config.model.window` or `model.window` (with `model` an alias of `config.model`) ->
  'model.window'; None for anything else."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if not isinstance(node, ast.Name) or node.id not in aliases:
    return None
  return ".".join(p for p in [aliases[node.id], *reversed(parts)] if p)


def field_comments(source: str) -> dict[str, str]:
  """Each config field a config file assigns -> the comment that says what it is, one line ('' for
  none), in the order of their first assignment (the first commented assignment gives the text)."""
  comments = {}  # line -> [column, text, whether the line holds nothing else]
  code_lines = set()
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      comments[token.start[0]] = [token.start[1], token.string.lstrip("#").strip(), True]
    elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
      code_lines.update(range(token.start[0], token.end[0] + 1))
  for line, comment in comments.items():
    comment[2] = line not in code_lines

  aliases = {"config": ""}
  out = {}
  statements = sorted((n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Assign)),
                      key=lambda n: n.lineno)
  for node in statements:
    paths = [_attribute_path(t, aliases) for t in node.targets]
    source_path = _attribute_path(node.value, aliases)  # `model = config.model`
    if source_path is None:  # `config.data = data = ml_collections.ConfigDict()`
      source_path = next((p for p in paths if p is not None), None)
    for target in node.targets:
      if isinstance(target, ast.Name) and source_path is not None:
        aliases[target.id] = source_path
    for path in paths:
      if path and "." in path and not out.get(path):
        out[path] = _comment_of(node, comments)
  return out


def _comment_of(node: ast.stmt, comments: dict[int, list]) -> str:
  """The trailing comment of `node` and its continuation lines; else the comment lines just above."""
  trailing = [line for line in range(node.lineno, node.end_lineno + 1)
              if line in comments and not comments[line][2]]
  texts = []
  if trailing:
    texts.append(comments[trailing[0]][1])
    line = node.end_lineno + 1
    while line in comments and comments[line][2] and comments[line][0] > node.col_offset:
      texts.append(comments[line][1])
      line += 1
  else:
    line = node.lineno - 1
    while line in comments and comments[line][2] and comments[line][0] == node.col_offset:
      texts.insert(0, comments[line][1])
      line -= 1
  return " ".join(t for t in texts if t)


@functools.lru_cache(maxsize=None)
def _file_comments(path: str) -> dict[str, str]:
  with open(path, encoding="utf-8") as f:
    return field_comments(f.read())


TYPED = {"data": data_config.DataConfig, "model": model_config.ModelConfig,
         "train": train_config.TrainConfig, "mesh": mesh_config.MeshConfig}  # declared sections


@functools.lru_cache(maxsize=None)
def _base_meanings() -> dict[str, str]:
  """config/base.py's comments; a typed section's fields (`TYPED`) from its class's declarations
  ('(type) doc'), in the sections' order."""
  comments = _file_comments(config_base.__file__)
  out = {}
  for section in config_base.base_config("dense"):
    if section in TYPED:
      out.update({f"{section}.{k}": f"({t}) {doc}" for k, (t, doc) in
                  _typed_docs(TYPED[section]).items()})
    else:
      out.update({k: v for k, v in comments.items() if k.split(".")[0] == section})
  for field, text in comments.items():
    out.setdefault(field, text)
  return out


def _setting_of(node: ast.stmt) -> tuple[str, str, str] | None:
  """(field, type, doc) of a typed section's `field: type = tc.setting(default, "doc", ...)`."""
  if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
          and isinstance(node.value, ast.Call)):
    return None
  func = node.value.func
  if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) != "setting":
    return None
  args = {i: a for i, a in enumerate(node.value.args)}
  args.update({{"default": 0, "doc": 1}.get(k.arg, -1): k.value for k in node.value.keywords})
  doc = args.get(1)
  text = doc.value if isinstance(doc, ast.Constant) and isinstance(doc.value, str) else ""
  return node.target.id, ast.unparse(node.annotation), text


MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "models")


@functools.lru_cache(maxsize=None)
def _family_sources(folder: str = MODELS_DIR) -> tuple[dict, dict, dict, dict, dict]:
  """What `efficient_lm/models/*.py` (or `folder`'s modules) declare, read with `ast` (importing
  them would import jax): {class: {field: (type, doc)}}, {class: base names}, {model name: its
  config class}, {model name: (config, line)} (its `register(...)` call's `listing`), {class:
  its `RULES` as `Rule.describe` states them}."""
  classes, bases, registered, listed, rules = {}, {}, {}, {}, {}
  for name in sorted(os.listdir(folder)):
    if not name.endswith(".py"):
      continue
    with open(os.path.join(folder, name), encoding="utf-8") as f:
      tree = ast.parse(f.read())
    literals = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    for node in tree.body:
      if isinstance(node, ast.For):
        _scan_registrations(node, literals, registered, listed)
    for node in ast.walk(tree):
      if isinstance(node, ast.ClassDef):
        classes[node.name] = dict(s[0:1] + ((s[1], s[2]),) for s in map(_setting_of, node.body)
                                  if s)
        bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
        rules[node.name] = [_rule_of(call) for stmt in node.body if isinstance(stmt, ast.Assign)
                            and any(getattr(t, "id", "") == "RULES" for t in stmt.targets)
                            for call in ast.walk(stmt.value) if _rule_of(call)]
      _registered(node, registered, listed, {}, literals)
  return classes, bases, registered, listed, rules


def _rule_of(node: ast.AST) -> str | None:
  """'field requirement' of a `tc.Rule("field", ok, "requirement", ...)` call (an f-string's
  parts in braces), as `Rule.describe` states it."""
  if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "Rule"
          and len(node.args) >= 3):
    return None
  text = lambda n: (n.value if isinstance(n, ast.Constant) else "".join(
      v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
      for v in getattr(n, "values", [])))
  return re.sub(r"![rs]}", "}", f"{text(node.args[0])} {text(node.args[2])}")


def family_rules(model: str) -> list[str]:
  """The cross-field rules of `model`'s config class (its `RULES`, its bases' within the
  package), read from the source like its fields."""
  _, bases, registered, _, rules = _family_sources()

  def of(cls: str) -> list[str]:
    return [r for base in bases.get(cls, []) for r in of(base)] + rules.get(cls, [])
  return of(registered[model])


_TOP = re.compile(r"^(?=[^\s#)\]}])", re.M)  # where a top-level statement starts
_LISTED = re.compile(r"(?:registry\.)?register\(|for \w+ in |[A-Z_]+ = ")


@functools.lru_cache(maxsize=None)
def listed_models(folder: str = MODELS_DIR) -> dict[str, tuple[str, str]]:
  """model name -> (the `--config=` that trains it, one line): each family's own declaration
  (`ModelEntry.listing` in its `register` call; tests/test_help.py checks it equals
  `models.REGISTRY`'s), in the order of the family modules (of `folder`). Only the top-level
  statements that can hold it are parsed (the module-level literals, `register` calls and the
  loops around them): `--help` stays fast."""
  listed = {}
  for name in sorted(os.listdir(folder)):
    if not name.endswith(".py"):
      continue
    with open(os.path.join(folder, name), encoding="utf-8") as f:
      source = f.read()
    starts = [m.start() for m in _TOP.finditer(source)] + [len(source)]
    body = []
    for a, b in zip(starts, starts[1:]):
      if _LISTED.match(source, a):
        try:
          body += ast.parse(source[a:b]).body
        except SyntaxError:  # (a line of a docstring that happens to start like one)
          continue
    literals = {t.id: node.value for node in body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    for node in body:
      _scan_registrations(node, literals, {}, listed)
  return listed


def _scan_registrations(node: ast.AST, literals: dict, registered: dict, listed: dict) -> None:
  """The `register(...)` calls of a top-level statement (in a loop over a literal's keys, once
  per key)."""
  if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
    keys = literals.get(getattr(node.iter, "id", None))  # `for name in VARIANTS: register(...)`
    names = [k.value for k in getattr(keys, "keys", getattr(keys, "elts", []))
             if isinstance(k, ast.Constant)]
    for call in ast.walk(node):
      _registered(call, registered, listed, {node.target.id: names}, literals)
  else:
    for call in ast.walk(node):
      _registered(call, registered, listed, {}, literals)


@functools.lru_cache(maxsize=None)
def family_docs() -> dict[str, dict[str, tuple[str, str]]]:
  """model name -> {field: (type, doc)} of the config class its module registers, read from the
  source of `efficient_lm/models/*.py` with `ast` (importing them would import jax): the class's
  `setting(...)` declarations and its bases' within the package, the shared ones included."""
  classes, bases, registered, _, _ = _family_sources()
  shared = _typed_docs(model_config.ModelConfig)

  def fields(cls: str) -> dict[str, tuple[str, str]]:
    out = dict(shared) if cls == "ModelConfig" else {}
    for base in bases.get(cls, []):
      out.update(fields(base))
    out.update(classes.get(cls, {}))
    return out
  return {model: fields(cls) for model, cls in registered.items()}


def _registered(node: ast.AST, out: dict[str, str], listed: dict[str, tuple[str, str]],
                loops: dict[str, list[str]], literals: dict[str, ast.AST]) -> None:
  """`register("name", ModelEntry(config=Cls, listing=("config", "line"), ...))` -> out["name"] =
  "Cls", listed["name"] = ("config", "line"); in a loop over a literal's keys, `listing` may be
  `LISTINGS[name]` of a module-level dict literal."""
  if not (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", ""))
          == "register" and len(node.args) == 2 and isinstance(node.args[1], ast.Call)):
    return
  keywords = {k.arg: k.value for k in node.args[1].keywords}
  cls = getattr(keywords.get("config"), "id", None)
  first = node.args[0]
  names = ([first.value] if isinstance(first, ast.Constant) else loops.get(getattr(first, "id", "")))
  listing = keywords.get("listing")
  for name in names or []:
    if cls:
      out[name] = cls
    if isinstance(listing, ast.Subscript) and getattr(listing.value, "id", None) in literals:
      listed[name] = tuple(ast.literal_eval(literals[listing.value.id])[name])
    elif listing is not None:
      listed[name] = tuple(ast.literal_eval(listing))


def _typed_docs(cls) -> dict[str, tuple[str, str]]:
  """{field: (type, doc)} of a typed section's class."""
  types = {f.name: getattr(f.type, "__name__", str(f.type)) for f in cls.declared().values()}
  return {k: (types[k], doc) for k, doc in cls.docs().items()}


def _config_path(spec: str) -> str:
  return config_files.resolve(spec).partition(":")[0]


def meanings(spec: str | None = None,
             config: ml_collections.ConfigDict | None = None) -> dict[str, str]:
  """Every field of `spec`'s config (a `--config=` form, or `config` if given, loaded from it;
  None: `base_config`) -> its one-line meaning ('' where its definition has no comment), in the
  order the files define them."""
  base = _base_meanings()
  if config is None:
    config = config_base.base_config("dense") if spec is None else config_files.load_config(spec)
  own = {} if spec is None else _file_comments(_config_path(spec))
  shared = leaves(config_base.base_config(config.model.name))
  declared = family_docs().get(config.model.name, {})  # its config class's declarations
  parameter_axes = axes.all_axes()
  order = {}
  for field in [*base, *own]:
    order.setdefault(field, len(order))
  out = {}
  for field in sorted(leaves(config), key=lambda f: (order.get(f, order.get(f.rpartition(".")[0],
                                                                            len(order))), f)):
    parent, _, key = field.rpartition(".")
    if parent in _MAPS:
      size = parameter_axes[key].size if key in parameter_axes else "?"
      out[field] = _MAPS[parent].format(key=key, size=size)
    elif field in shared:
      out[field] = base.get(field, "")
    elif parent == "model" and key in declared:
      kind, doc = declared[key]
      out[field] = f"({kind}) {doc}"
    else:
      out[field] = own.get(field, "")
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
  stated = [r.describe() for r in model_config.SHARED_RULES] + family_rules(model) + [
      r.describe() for r in model_config.SEQ_CHUNK_RULES]
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


__all__ = ["MODELS", "HelpError", "answer", "family_fields", "field_comments", "leaves", "listing",
           "meanings", "model_listing", "requested"]
