"""Imports of the library inside functions are few, and each says why it cannot be at the top of
its module: a heavy wing kept off a light path (`--help`, a command-line mistake answered before
jax starts, `import efficient_lm`), or an accelerator's kernels loaded only when asked for. The
import graph has no circle to break (tests/test_imports.py), so any other belongs at the top."""

import ast
import os

import efficient_lm

ROOT = os.path.dirname(efficient_lm.__file__)
MAX_FUNCTION_IMPORTS = 15  # 41 before issue 61's clean-up


def function_imports(source: str) -> list[tuple[int, bool]]:
  """(line, has a reason) of each `import efficient_lm...` / `from efficient_lm... import` inside a
  function of `source`. The reason is a comment just above the import, over any imports between
  (`# Imported here: jax loads only after the flags are checked.`); a pylint pragma is none."""
  lines = source.splitlines()
  found = set()
  for function in ast.walk(ast.parse(source)):
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    for node in ast.walk(function):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and not node.level:
        names = [node.module or ""]
      else:
        names = ["efficient_lm"] if isinstance(node, ast.ImportFrom) else []
      if any(name == "efficient_lm" or name.startswith("efficient_lm.") for name in names):
        found.add(node.lineno)
  return [(line, _has_reason(lines, line)) for line in sorted(found)]


def _has_reason(lines: list[str], line: int) -> bool:
  index = line - 2  # the line above, 0-based
  while index >= 0:
    text = lines[index].strip()
    if text.startswith("#"):
      words = text.lstrip("#").strip()
      if words and not words.startswith("pylint:"):
        return True
    elif not text.startswith(("import ", "from ")):
      return False
    index -= 1
  return False


def library_function_imports() -> dict[str, list[tuple[int, bool]]]:
  out = {}
  for folder, _, names in os.walk(ROOT):
    for name in sorted(names):
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        with open(path, encoding="utf-8") as f:
          found = function_imports(f.read())
        if found:
          out[os.path.relpath(path, os.path.dirname(ROOT))] = found
  return out


def test_few_imports_of_the_library_inside_functions():
  found = library_function_imports()
  listing = "\n".join(f"{path}:{line}" for path, lines in found.items() for line, _ in lines)
  count = sum(len(lines) for lines in found.values())
  assert count <= MAX_FUNCTION_IMPORTS, (
      f"{count} imports of efficient_lm inside functions (at most {MAX_FUNCTION_IMPORTS}); move "
      f"the new ones to the top of their modules:\n{listing}")


def test_each_import_inside_a_function_says_why():
  found = library_function_imports()
  silent = [f"{path}:{line}" for path, lines in found.items() for line, why in lines if not why]
  assert not silent, ("imports of efficient_lm inside functions without a comment above saying "
                      "why they are not at the top: " + ", ".join(silent))


def test_the_count_sees_what_it_counts():
  source = ("import os\nfrom efficient_lm import data\n\n"
            "def quiet():\n  from efficient_lm.ops import ring  # pylint: disable=import-outside-toplevel\n"
            "  import json\n  return ring, json\n\n"
            "def said():\n  # Imported here: jax loads only after the flags are checked.\n"
            "  import numpy\n  from efficient_lm.evaluation import scoring\n"
            "  import efficient_lm.api\n  return numpy, scoring\n")
  assert function_imports(source) == [(5, False), (12, True), (13, True)]
