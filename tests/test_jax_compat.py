"""`efficient_lm/runtime/jax_compat.py`: every private jax API behind one module, each with its
fallback.

On the installed jax (0.10.2 here; 0.12.0.1 in CI's Python 3.12 stage, see
docs/accelerators.md) every private feature is present and binds the way the library calls it;
with each one taken away the fallback runs: splash calls go to `xla` (and still match the
reference), the cuDNN patch is a no-op, the concrete mesh comes from jax's public getter outside
tracing, libtpu's path from libtpu itself. No library or experiment file reaches into jax's
private modules elsewhere.
"""
# pylint: disable=protected-access

import ast
import importlib
import os
import re
import runpy
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from efficient_lm.ops import core, precision
from efficient_lm.ops.core import backends, splash
from efficient_lm.ops.pattern import Pattern
from efficient_lm.runtime import jax_compat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _private_uses(path: str) -> list[str]:
  """`jax._src` imports and `._splash_attention_*` attributes in one Python file, also by name
  in a string (its code, not its comments)."""
  tree = ast.parse(open(path, encoding="utf-8").read(), path)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
      found.append(f"{path}:{node.lineno} from {node.module} import ...")
    elif isinstance(node, ast.Import):
      found += [f"{path}:{node.lineno} import {a.name}" for a in node.names
                if a.name.startswith("jax._src")]
    elif isinstance(node, ast.Attribute) and (node.attr.startswith("_splash_attention")
                                              or node.attr == "_src"):
      found.append(f"{path}:{node.lineno} .{node.attr}")
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
        node.value.startswith(("jax._src", "_splash_attention"))):  # importlib / getattr by name
      found.append(f"{path}:{node.lineno} {node.value!r}")
  return found


def test_no_private_jax_outside_the_compat_module():
  """(and this file, which takes jax's private pieces away to run the fallbacks)"""
  allowed = {os.path.join(REPO, "efficient_lm", "runtime", "jax_compat.py"),
             os.path.abspath(__file__)}
  uses = []
  for folder in ("efficient_lm", "experiments", "tests", "configs"):
    for root, _, files in os.walk(os.path.join(REPO, folder)):
      for name in files:
        path = os.path.join(root, name)
        if name.endswith(".py") and path not in allowed:
          uses += _private_uses(path)
  assert not uses, uses
  # The scanner finds what it is for.
  compat = os.path.join(REPO, "efficient_lm", "runtime", "jax_compat.py")
  found = " ".join(_private_uses(compat))
  for name in ("from jax._src import", "jax._src.cudnn", "_splash_attention_bwd_dq"):
    assert name in found, (name, found)


def test_setup_declares_the_compat_range_and_this_jax_is_in_it(monkeypatch):
  declared = {}
  fake = types.SimpleNamespace(setup=declared.update, find_packages=lambda **kw: [])
  monkeypatch.setitem(sys.modules, "setuptools", fake)  # what setup.py declares, nothing built
  runpy.run_path(os.path.join(REPO, "setup.py"))
  jax_lines = [r for r in declared["install_requires"] if re.match(r"jax\b", r)]
  assert jax_lines == ["jax" + jax_compat.JAX_REQUIREMENT], jax_lines
  extras = declared["extras_require"]
  assert extras["tpu"] == ["jax[tpu]" + jax_compat.JAX_REQUIREMENT]
  assert extras["gpu"] == ["jax[cuda12]" + jax_compat.JAX_REQUIREMENT]
  assert jax_compat.supported(jax.__version__), (jax.__version__, jax_compat.JAX_REQUIREMENT)
  for version in ("0.10.2", "0.11.2", "0.12.0", "0.12.0.1", "0.12.9.dev20270101"):
    assert jax_compat.supported(version), version
  for version in ("0.10.1", "0.9.0", "0.13.0", "0.13.0.dev20270101", "1.0.0"):
    assert not jax_compat.supported(version), version
  assert not jax_compat.supported("")


def test_ci_runs_the_readme_command_then_the_fast_tier_on_the_newest_jax():
  """.ci/run: the README's test command first, unchanged; then a Python 3.12 venv given the newest
  jax of the range it reads from jax_compat.py (checked by running its own sed) whose `tpu` extra
  installs (jax with that extra, as the library's `tpu` extra asks: a jax published before its
  libtpu must not be picked and then moved back), the library after it, and the fast tier;
  `set -e` so that either stage failing fails CI."""
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    readme_test_command = f.read().splitlines()[3].strip()  # the README's second command line
  assert readme_test_command.startswith("pip install -e '.[test") and "pytest" in readme_test_command
  path = os.path.join(REPO, ".ci", "run")
  with open(path, encoding="utf-8") as f:
    script = f.read()
  commands = [line for line in script.splitlines() if line and not line.startswith("#")]
  assert commands[:3] == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', readme_test_command]
  assert subprocess.run(["bash", "-n", path], check=False).returncode == 0
  sed = next(line for line in commands if line.startswith("JAX_REQUIREMENT="))
  read = subprocess.run(["bash", "-c", f'{sed}\nprintf %s "$JAX_REQUIREMENT"'], cwd=REPO,
                        capture_output=True, text=True, check=True).stdout
  assert read == jax_compat.JAX_REQUIREMENT, read
  installs = [line for line in commands if '/bin/pip" install' in line]
  assert '"jax[tpu]$JAX_REQUIREMENT"' in installs[0] and "-e '.[test,tpu]'" in installs[1], installs
  assert commands[-1] == '"$VENV/bin/python" -m pytest -m "not slow" -n auto'


def test_this_jax_has_every_private_feature():
  assert jax_compat.missing() == []
  info = jax_compat.report()
  assert info["jax"] == jax.__version__ and info["jax_supported"]
  line = jax_compat.report_line(info)
  assert "\n" not in line and line.startswith(f"jax {jax.__version__} (jaxlib ")
  assert line.endswith("; missing: none")


def test_the_report_names_what_is_missing(monkeypatch):
  monkeypatch.setattr(jax_compat, "_private_concrete_mesh", lambda: None)
  monkeypatch.setattr(jax_compat, "_cudnn_module", lambda: None)
  info = {**jax_compat.report(), "jax": "0.13.0", "jax_supported": False}
  line = jax_compat.report_line(info)
  assert "\n" not in line and "jax outside the tested >=0.10.2,<0.13" in line
  assert "get_concrete_mesh is absent" in line and "cuDNN capability checks" in line


def test_xla_differences_follow_jaxlib(monkeypatch):
  for version, flag in (("0.10.2", "--xla_cpu_use_fusion_emitters=false"), ("0.11.2", ""),
                        ("0.12.0.dev20260101", ""), ("0.12.0.1", "")):
    monkeypatch.setattr(jax_compat, "_version", lambda name, v=version: v)
    assert jax_compat.classic_cpu_emitters_flag() == flag
    assert jax_compat.warns_of_full_rematerialization() == bool(flag)
  monkeypatch.setattr(jax_compat, "_version", lambda name: None)
  assert jax_compat.classic_cpu_emitters_flag() == "" and jax_compat.jaxlib_release() == ()


# Splash.

def _recording_splash_module(monkeypatch):
  """The splash kernel module with its three private pieces wrapped to record their calls."""
  module = importlib.import_module(jax_compat.SPLASH_MODULE)
  calls = {}
  for name in jax_compat.SPLASH_CALLS:
    original = getattr(module, name)

    def record(*args, _name=name, _original=original, **kwargs):
      calls[_name] = (len(args), set(kwargs))
      return _original(*args, **kwargs)

    monkeypatch.setattr(module, name, record)
  return calls


def test_splash_calls_bind_as_the_compat_module_checks(monkeypatch):
  """What splash.py passes is what `SPLASH_CALLS` checks jax's signatures against."""
  calls = _recording_splash_module(monkeypatch)
  monkeypatch.setattr(jax_compat, "_splash_checked", None)
  q = k = v = jax.random.normal(jax.random.key(0), (1, 16, 1, 8))
  fn = lambda q, k, v: core.attend(q, k, v, Pattern.sliding(5), impl="splash", interpret=True)[0]
  jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2))(q, k, v)
  assert set(calls) == set(jax_compat.SPLASH_CALLS)
  for name, (positional, keywords) in jax_compat.SPLASH_CALLS.items():
    assert calls[name] == (positional, set(keywords)), name


@pytest.mark.parametrize("change", ["absent", "renamed keyword"])
def test_without_the_splash_pieces_calls_run_on_xla(monkeypatch, change):
  module = importlib.import_module(jax_compat.SPLASH_MODULE)
  if change == "absent":
    monkeypatch.delattr(module, "_splash_attention_bwd_dq")
  else:
    def forward(fwd_mask_info, q, k, v, segment_ids, sinks, *, mask_val, is_mqa, block_sizes,
                residual_checkpoint_name, save_residuals, mask_function, interpret=False):
      raise AssertionError("not called")
    monkeypatch.setattr(module, "_splash_attention_forward", forward)
  monkeypatch.setattr(jax_compat, "_splash_checked", None)
  reason = jax_compat.splash_missing()
  assert reason is not None and "\n" not in reason
  assert ("is absent" if change == "absent" else "takes other arguments now") in reason
  assert any(reason in line for line in jax_compat.missing())
  with pytest.raises(NotImplementedError):
    jax_compat.splash_forward()
  call = backends.Call(pattern=Pattern.sliding(4), scale=0.25, Tq=16, Tk=16, q_start=0, k_start=0,
                       k_offset=0, q_align=1, explicit=False, local_prior=False, skip_prior=False,
                       layout="BTHK", dtype="float32")
  assert splash.unsupported(call) == reason
  before = core.FALLBACKS[("splash", reason)]
  q, k, v = (jax.random.normal(key, (1, 16, 2, 8)) for key in jax.random.split(jax.random.key(1), 3))
  got = core.attend(q, k, v, Pattern.sliding(4), impl="splash", interpret=True)
  want = core.attend(q, k, v, Pattern.sliding(4), impl="reference")
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=2e-5)
  assert core.FALLBACKS[("splash", reason)] == before + 1
  monkeypatch.undo()
  jax_compat._splash_checked = None
  assert jax_compat.splash_missing() is None  # the real module again


# cuDNN's capability checks.

def test_cudnn_capability_answers_are_patched_only_inside():
  cudnn_lib = importlib.import_module(jax_compat.CUDNN_MODULE)
  before = cudnn_lib.check_compute_capability, cudnn_lib.is_cuda_compute_capability_equal
  with jax_compat.cudnn_capability_answers((9, 0)):
    assert cudnn_lib.check_compute_capability("9.0") and cudnn_lib.check_compute_capability("8.0")
    assert not cudnn_lib.check_compute_capability("10.0")
    assert cudnn_lib.is_cuda_compute_capability_equal("9.0")
    assert not cudnn_lib.is_cuda_compute_capability_equal("10.3")
  assert (cudnn_lib.check_compute_capability, cudnn_lib.is_cuda_compute_capability_equal) == before
  with jax_compat.cudnn_capability_answers(None):  # no target: jax's own checks
    assert cudnn_lib.check_compute_capability is before[0]
  with pytest.raises(RuntimeError):  # restored on errors too
    with jax_compat.cudnn_capability_answers((8, 0)):
      raise RuntimeError("inside")
  assert cudnn_lib.check_compute_capability is before[0]


def test_without_the_cudnn_checks_nothing_is_patched(monkeypatch):
  cudnn_lib = importlib.import_module(jax_compat.CUDNN_MODULE)
  monkeypatch.delattr(cudnn_lib, "is_cuda_compute_capability_equal")
  assert jax_compat._cudnn_module() is None
  before = cudnn_lib.check_compute_capability
  with jax_compat.cudnn_capability_answers((9, 0)):
    assert cudnn_lib.check_compute_capability is before
  assert any("cuDNN capability checks" in line for line in jax_compat.missing())


# The concrete mesh.

def _one_device_mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))


def test_concrete_mesh_while_tracing():
  assert jax_compat.concrete_mesh() is None
  mesh = _one_device_mesh()
  seen = []
  with jax.set_mesh(mesh):
    assert jax_compat.concrete_mesh() == mesh
    jax.jit(lambda x: seen.append(jax_compat.concrete_mesh()) or x)(1.0)
  assert seen == [mesh]
  assert precision.platform() == "cpu"


def test_without_the_private_getter_the_public_one_serves_outside_tracing(monkeypatch):
  monkeypatch.setattr(jax_compat, "_private_concrete_mesh", lambda: None)
  mesh = _one_device_mesh()
  assert jax_compat.concrete_mesh() is None
  seen = []
  with jax.set_mesh(mesh):
    assert jax_compat.concrete_mesh() == mesh
    jax.jit(lambda x: seen.append(jax_compat.concrete_mesh()) or x)(2.0)
    assert precision.platform() == "cpu"  # the host's backend when the mesh is not seen
  assert seen == [None]
  assert any("get_concrete_mesh is absent" in line for line in jax_compat.missing())


# libtpu.

def test_tpu_library_path_fallback_agrees(monkeypatch):
  private = jax_compat.tpu_library_path()
  xla_bridge = importlib.import_module("jax._src.xla_bridge")
  monkeypatch.delattr(xla_bridge, "get_tpu_library_path")
  assert jax_compat.tpu_library_path() == private
  if private is not None:
    assert os.path.isfile(private)
    monkeypatch.setitem(sys.modules, "libtpu", None)  # libtpu not importable
    monkeypatch.setenv("TPU_LIBRARY_PATH", private)
    assert jax_compat.tpu_library_path() == private
    monkeypatch.delenv("TPU_LIBRARY_PATH")
    assert jax_compat.tpu_library_path() is None


def test_release_parsing():
  assert jax_compat._release("0.11.2") == (0, 11, 2)
  assert jax_compat._release("0.12.0.dev20260101+abc") == (0, 12, 0)
  assert jax_compat._release(None) == () and jax_compat._release("unknown") == ()
