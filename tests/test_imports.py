"""The package's import graph has no circles: every `import` statement in efficient_lm/, those
inside functions included, read from the source."""

import ast
import os
import subprocess
import sys

import efficient_lm

ROOT = os.path.dirname(efficient_lm.__file__)


def module_graph() -> dict[str, set[str]]:
  """{module: the package modules it imports}, from the source of every file under efficient_lm/."""
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
      if isinstance(node, ast.Import):
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


def test_a_circle_is_found():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


LIGHT = """
import sys
from efficient_lm import cli
for name in ("pi_attention", "dense", "bcmt:honly", "perceiver_ar:compressed", "ecp", "sliding_window"):
  cli.load_config(name)
from efficient_lm import workdir
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
