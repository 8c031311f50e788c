"""`--help` and `--help=<model>`: every model and every config field, each field's meaning its
declaration's (the sections' classes, each family's in `efficient_lm.families`), from the three
commands, without jax."""

import subprocess
import sys
import time

import pytest

from conftest import REPO
from efficient_lm.cli import common as cli
from efficient_lm.cli import help as help_lib
from efficient_lm.config import base as config_base

COMMANDS = {"efficient_lm.main": "Trains a model", "efficient_lm.sample": "Samples text",
            "efficient_lm.evaluate": "Evaluates a trained workdir"}  # their docstrings' first words


def run(args, module="efficient_lm.main"):
  return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                        cwd=REPO, timeout=120)


def shipped_specs() -> list[str]:
  """Every shipped config by name, and every model's config (presets included)."""
  return sorted(set(cli.config_names()) | {spec for spec, _ in help_lib.MODELS.values()})


@pytest.mark.parametrize("spec", shipped_specs())
def test_every_field_of_every_shipped_config_has_a_meaning(spec):
  """A field declared without a doc (its `setting(default, doc, ...)`) fails here."""
  config = cli.load_config(spec)
  meaning = help_lib.meanings(spec)
  assert sorted(meaning) == sorted(help_lib.leaves(config))
  missing = [field for field, text in meaning.items() if not text.strip()]
  assert not missing, (f"{spec}: no doc for {missing}; write what each is in its declaration "
                       "(`setting(default, doc, check)`)")


def test_the_model_list_is_the_registry():
  """`MODELS`, each family's declaration read without jax (`efficient_lm.families`), names exactly
  the registered models with the listing the registry took (the config that trains it, one
  line); each config trains its model."""
  from efficient_lm import models  # pylint: disable=import-outside-toplevel  (imports jax)
  assert help_lib.MODELS == {name: e.listing for name, e in models.REGISTRY.items()}
  for model, (spec, line) in help_lib.MODELS.items():
    assert cli.load_config(spec).model.name == model
    assert line.strip()


def test_a_field_means_what_its_class_declares():
  """Every meaning is the declaration's: the section's class, or the model's family's (shared
  fields included), '(type) doc'; a field nothing declares has none."""
  from efficient_lm import families  # pylint: disable=import-outside-toplevel
  for spec in ("bcmt", "bcmt:honly", "perceiver_ar:compressed", "pi_attention"):
    config = cli.load_config(spec)
    cls = families.CLASSES[config.model.name]
    meaning = help_lib.meanings(spec, config)
    for field, doc in cls.docs().items():
      kind = getattr(cls.declared()[field].type, "__name__", str(cls.declared()[field].type))
      assert meaning[f"model.{field}"] == f"({kind}) {doc}", (spec, field)
  config = cli.load_config("dense")
  with config.unlocked():
    config.model.undeclared = 1
  assert help_lib.meanings("dense", config)["model.undeclared"] == ""


def test_config_base_aliases_and_shared_fields():
  """The shared meanings are the typed sections' declarations (with their type: `DataConfig`,
  `ModelConfig`, ...), a family's own fields its config class's (no jax: `families`)."""
  meaning = help_lib.meanings()
  assert meaning["data.seq_len"] == "(int) tokens per training window (the model's context)"
  assert meaning["model.d_model"] == "(int) residual stream width"
  assert help_lib.meanings("bcmt")["model.alpha"] == "(float) memory decay per block, in (0, 1)"
  assert help_lib.meanings("bcmt:honly")["model.alpha"].endswith("unused by honly")
  assert help_lib.meanings("perceiver_ar:ssplit")["model.num_history_segments"].startswith(
      "(int) ssplit: history segments")
  assert meaning["mesh.rules.embed"] == "mesh axes of the parameter axis `embed` (size model.d_model)"
  # A family's comment on a shared field it changes does not replace the shared meaning.
  assert help_lib.meanings("pi_attention")["data.seq_len"] == meaning["data.seq_len"]


@pytest.mark.parametrize("module", COMMANDS)
def test_help_exits_0_with_every_model_and_field(module):
  start = time.perf_counter()
  done = run(["--help"], module=module)
  seconds = time.perf_counter() - start
  assert done.returncode == 0, done.stderr[-2000:]
  text = done.stdout
  assert text.startswith(COMMANDS[module])
  assert "--workdir" in text
  for model in help_lib.MODELS:
    assert f"\n  {model} " in text, model
  fields = set(help_lib.leaves(config_base.base_config("dense")))
  for family in cli.config_names():
    fields |= set(help_lib.family_fields(family)[0])
  for field in fields:
    assert f"\n  {field} = " in text, field
  assert seconds < 10, f"--help took {seconds:.1f} s"


@pytest.mark.parametrize("module,script,flag", [("main", "efficient-lm-train", "--compile_only"),
                                                ("sample", "efficient-lm-sample", "--top_p"),
                                                ("evaluate", "efficient-lm-eval", "--ablate_context")])
def test_console_script_help(module, script, flag):
  """The console scripts' entries (setup.py: `efficient_lm.<module>:run`) answer the same, each
  with its own flags."""
  done = subprocess.run([sys.executable, "-c", f"import sys; from efficient_lm import {module}; "
                         f"sys.argv = ['{script}', '--help']; {module}.run()"],
                        capture_output=True, text=True, cwd=REPO, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert f"\n  {flag} " in done.stdout and "\n  model.d_model = 256" in done.stdout


@pytest.mark.parametrize("model", sorted(help_lib.MODELS))
def test_help_for_a_model_lists_what_it_reads(model):
  spec = help_lib.MODELS[model][0]
  text = help_lib.model_listing(model, width=100)
  config = cli.load_config(spec)
  own, _ = help_lib.family_fields(spec.partition(":")[0], config)
  for field, value in help_lib.leaves(config).items():
    assert f"\n  {field} = {value!r}" in text, field
  others = set().union(*(help_lib.family_fields(f)[0] for f in cli.config_names())) - set(own)
  for field in others:  # another family's fields are not this model's
    assert f"\n  {field} = " not in text, field


def test_help_for_a_model_from_the_command_line():
  done = run(["--help=pi_attention"])
  assert done.returncode == 0, done.stderr[-2000:]
  assert "\n  model.window = 128" in done.stdout and "\n  data.seq_len = 512" in done.stdout
  assert "model.block_size" not in done.stdout


def test_an_unknown_model_is_one_error_line():
  done = run(["--help=nope"], module="efficient_lm.sample")
  assert done.returncode == 2
  assert done.stderr.strip().splitlines() == [done.stderr.strip()]
  assert done.stderr.startswith("error: --help=nope: there is no model 'nope'; use one of "
                                + ", ".join(help_lib.MODELS))
  assert done.stdout == ""


LIGHT = """
import sys
from efficient_lm.cli import help
help.listing(); help.model_listing('bcmt')
print(",".join(sorted(m for m in ("jax", "flax", "tensorflow_datasets", "grain", "orbax")
                      if m in sys.modules)) or "none")
"""


def test_help_needs_no_jax():
  done = subprocess.run([sys.executable, "-c", LIGHT], capture_output=True, text=True, cwd=REPO,
                        timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == "none"


def test_each_models_rules_are_the_ones_its_class_runs():
  """`--help=<model>` states the rules its config class runs (`all_rules()`: the shared ones, its
  family's `RULES`, the sequence chunks'), each as `Rule.describe` states it."""
  from efficient_lm import families  # pylint: disable=import-outside-toplevel
  for name, cls in families.CLASSES.items():
    text = " ".join(help_lib.model_listing(name, width=100000).split())
    stated = text.split("Rules across its fields (checked before anything runs; {field} is its "
                        "value): ", 1)[1]
    described = [r.describe() for r in cls.all_rules()]
    assert stated.startswith("; ".join(described)), name
    assert all(r.describe() in stated for r in cls.RULES), name
  text = lambda model: " ".join(help_lib.model_listing(model).split())
  assert "model.block_size must divide data.seq_len={seq_len}" in text("honly")
  assert "model.num_segments must divide model.seq_len={seq_len}" in text("ecp")
