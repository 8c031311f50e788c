"""The package's import graph has no circles: every `import` statement in efficient_lm/, those
inside functions included, read from the source (`from package import module` is an edge to the
module). Under efficient_lm/ops no import hides from the graph: no module name is computed at
run time, and a literal `importlib.import_module` counts as an import."""

import ast
import importlib
import os
import subprocess
import sys

import efficient_lm

ROOT = os.path.dirname(efficient_lm.__file__)


def module_graph(literal: bool = False) -> dict[str, set[str]]:
  """{module: the package modules it imports}, from the source of every file under efficient_lm/
  (with `literal`, also those `importlib.import_module` names literally)."""
  paths = {}
  for folder, _, files in os.walk(ROOT):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        module = "efficient_lm." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        paths[module.removesuffix(".__init__")] = path
  graph = {module: set() for module in paths}
  for module, path in paths.items():
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if literal and literal_import(node) in paths:
        graph[module].add(literal_import(node))
      elif isinstance(node, ast.Import):
        graph[module] |= {a.name for a in node.names if a.name in paths}
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(parts + ([base] if base else []))
        for alias in node.names:
          target = f"{base}.{alias.name}"
          graph[module].add(target if target in paths else base) if (
              target in paths or base in paths) else None
  return graph


def literal_import(node: ast.AST) -> str | None:
  """The module `importlib.import_module("name")` / `__import__("name")` names, if `node` is such
  a call with a literal name."""
  if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
    return None
  func = node.func
  name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
  return node.args[0].value if name in ("import_module", "__import__") else None


def computed_imports(path: str) -> list[int]:
  """Lines of `path` that import a module by a name computed at run time (invisible to the graph)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
          and (getattr(node.func, "attr", None) == "import_module"
               or getattr(node.func, "id", None) in ("import_module", "__import__"))
          and literal_import(node) is None]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Every strongly connected component of more than one module (or a module importing itself)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1 or v in graph[v]:
        found.append(sorted(component))

  for v in graph:
    if v not in index:
      visit(v)
  return found


def test_the_import_graph_has_no_circles():
  graph = module_graph()
  assert len(graph) > 50 and graph["efficient_lm.models.layers"]  # the graph was read
  assert cycles(graph) == []


# The imports made by a name computed at run time, each with the modules it may load: the model
# families' and config declarations' discovery (every module of their package) and the data
# registry's hooks (`data.hooks`, the modules `registry.SOURCES` names); jax_compat loads jax's.
DISCOVERING = ("efficient_lm.models", "efficient_lm.families")


def loaded_by_name(graph: dict[str, set[str]]) -> dict[str, set[str]]:
  """{module: the package modules it imports by a computed name}."""
  from efficient_lm.data import hooks, registry  # pylint: disable=g-import-not-at-top
  loads = {package: {m for m in graph if m.rpartition(".")[0] == package} for package in DISCOVERING}
  loads["efficient_lm.data.hooks"] = {f"efficient_lm.data.{module}" for source in
                                      registry.SOURCES.values() for module in hooks.hook_modules(source)}
  return loads


def test_no_circle_with_the_loads_by_name():
  """The edges no `import` statement shows (a plugin's discovery, a registry's hooks) are added,
  and still no circle: a family's module imports the models' registry, which imports no family;
  a data source imports the data registry, which names its hooks and imports none of them."""
  graph = module_graph(literal=True)
  computed = {os.path.relpath(folder, ROOT) + "/" + name for folder, _, names in os.walk(ROOT)
              for name in names if name.endswith(".py")
              and computed_imports(os.path.join(folder, name))}
  assert computed == {"runtime/jax_compat.py", "models/__init__.py", "families/__init__.py",
                      "data/hooks.py"}, computed  # nothing else hides an import
  loads = loaded_by_name(graph)
  assert "efficient_lm.data.needle" in loads["efficient_lm.data.hooks"]
  assert "efficient_lm.models.gated_deltanet" in loads["efficient_lm.models"]
  for module, targets in loads.items():
    graph[module] |= targets
  assert cycles(graph) == []
  # the check sees such a tie: the registry importing the needle source it names was one
  graph["efficient_lm.data.registry"].add("efficient_lm.data.needle")
  assert ["efficient_lm.data.needle", "efficient_lm.data.registry"] in cycles(graph)


def test_ops_imports_are_all_visible_and_acyclic():
  """Every module under efficient_lm/ops imports, none by a computed name; none imports a module
  that (transitively, function-level imports included) imports it back: the backend registry
  loads the backends, and no backend reaches the registry."""
  graph = module_graph(literal=True)
  ops = sorted(m for m in graph if m.startswith("efficient_lm.ops"))
  for module in ops:
    importlib.import_module(module)
    path = os.path.join(ROOT, *module.split(".")[1:])
    path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
    assert computed_imports(path) == [], (module, computed_imports(path))
  registry = "efficient_lm.ops.core.backends"
  assert {f"efficient_lm.ops.core.{name}" for name in ("xla", "splash", "gpu", "reference")} <= (
      graph[registry])
  for module in ops:
    reached, todo = set(), [module]
    while todo:
      for target in graph[todo.pop()] - reached:
        reached.add(target)
        todo.append(target)
    assert module not in reached, module


def test_a_hidden_import_is_found():
  """The checks can fail: a computed `import_module` is flagged, a literal one is an edge."""
  tree = ast.parse("import importlib\nimportlib.import_module(NAMES[0])\n"
                   "importlib.import_module('efficient_lm.ops.core.xla')\n")
  calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
  assert [literal_import(n) for n in calls] == [None, "efficient_lm.ops.core.xla"]


def test_a_circle_is_found():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


LIGHT = """
import sys
from efficient_lm.cli import common as cli
from efficient_lm.cli import help as help_lib
for name in sorted(set(cli.config_names()) | {spec for spec, _ in help_lib.MODELS.values()}):
  cli.load_config(name)  # every shipped config, and each model's (presets too)
from efficient_lm.state import workdir
heavy = sorted(m for m in ("jax", "flax", "tensorflow_datasets", "grain", "orbax") if m in sys.modules)
print(",".join(heavy) or "none")
"""


def test_configs_load_without_jax():
  """A command-line or config mistake, and a workdir that config.json refuses, answer before jax
  starts: loading every shipped config and the workdir checks import none of the heavy libraries."""
  done = subprocess.run([sys.executable, "-c", LIGHT], capture_output=True, text=True,
                        cwd=os.path.dirname(ROOT), timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == "none", done.stdout
