"""The wings' contract (`.importlinter`, drawn in docs/architecture.md): lint-imports keeps it on
this checkout, it names every wing and command the package has, and it breaks when a lower wing
imports a higher one, a sibling imports its sibling, the models reach the data pipeline, or
anything below the command lines reads ml-collections or absl's flags (imports inside functions
included)."""

import os
import shutil
import subprocess
import sys

import pytest
from importlinter import api as importlinter_api

from conftest import REPO

CONFIG = os.path.join(REPO, ".importlinter")
LINT = ("import sys\nfrom importlinter.cli import lint_imports\n"
        "sys.exit(lint_imports(config_filename='.importlinter', no_cache=True, no_logo=True))\n")


def layers() -> list[str]:
  """The layers of the contract's layers contract, high to low (`a | b` for siblings)."""
  (contract,) = [c for c in importlinter_api.read_configuration(CONFIG)["contracts_options"]
                 if c["type"] == "layers"]
  return contract["layers"]


def lint(root: str) -> subprocess.CompletedProcess:
  """lint-imports on the package under `root` (its `efficient_lm/` and `.importlinter`)."""
  env = {**os.environ, "PYTHONPATH": root}
  return subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True,
                        text=True, timeout=300, check=False)


def test_the_contract_is_kept():
  done = lint(REPO)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
  assert "Contracts: 4 kept, 0 broken." in done.stdout, done.stdout[-3000:]


def test_the_contract_names_every_wing_and_command():
  """Each subpackage of efficient_lm and each module beside `__init__` is a layer: a new wing or
  command cannot sit outside the contract."""
  named = {name.strip() for line in layers() for name in line.split("|")}
  package = os.path.join(REPO, "efficient_lm")
  present = {name.removesuffix(".py") for name in os.listdir(package)
             if (name.endswith(".py") and name != "__init__.py")
             or os.path.isfile(os.path.join(package, name, "__init__.py"))}
  assert named == present


@pytest.mark.parametrize("module, line, broken", [
    # a lower wing importing a higher one, inside a function
    ("config/errors.py", "def _upward():\n  from efficient_lm.training import loop\n  return loop\n",
     "efficient_lm.config.errors -> efficient_lm.training.loop"),
    # a sibling importing its sibling (parallel | data)
    ("parallel/sharding.py", "from efficient_lm.data import corpus\n",
     "efficient_lm.parallel.sharding -> efficient_lm.data.corpus"),
    # the models reaching the data pipeline (allowed by the layers, refused by independence)
    ("models/layers.py", "from efficient_lm.data import corpus\n",
     "efficient_lm.models.layers -> efficient_lm.data.corpus"),
    # a ConfigDict below the command lines (one config object there: a RunConfig), inside a
    # function too
    ("state/workdir.py", "def _config():\n  import ml_collections\n  return ml_collections\n",
     "efficient_lm.state.workdir -> ml_collections"),
    # a flag read below the command lines
    ("data/config.py", "from absl import flags\n", "efficient_lm.data.config -> absl"),
])
def test_an_import_against_the_wings_breaks_it(tmp_path, module, line, broken):
  shutil.copytree(os.path.join(REPO, "efficient_lm"), tmp_path / "efficient_lm",
                  ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(CONFIG, tmp_path / ".importlinter")
  with open(tmp_path / "efficient_lm" / module, "a", encoding="utf-8") as f:
    f.write("\n\n" + line)
  done = lint(str(tmp_path))
  assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
  assert "BROKEN" in done.stdout and broken in done.stdout, done.stdout[-3000:]


def test_the_architecture_page_draws_the_contract():
  """docs/architecture.md opens with the wings' arrows: the same layers, in the same order."""
  with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as f:
    page = f.read()
  section = page.split("## The wings\n", 1)[1].split("\n## ", 1)[0]
  drawn = " ".join(line.strip() for line in section.splitlines() if line.startswith("    "))
  normal = lambda layer: " | ".join(name.strip() for name in layer.split("|"))  # noqa: E731
  assert [normal(layer) for layer in drawn.split("->")] == [normal(l) for l in layers()]
