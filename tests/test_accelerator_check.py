"""The device check (experiments/accelerator_check.sh and .py, accelerator_backends.py,
accelerator_step.py, device_wheels.sh) on this CPU host.

It fails loudly in one line when python, jax or the library cannot start, when a row fails
or a visible GPU has no jax backend, and exits 0 only when jax reports no accelerator. Its
whole path runs on CPU (`ACCELERATOR_CHECK_PLATFORM=cpu`) in a Python shaped like the GPU
machine's: a `sitecustomize` makes grain, tensorflow-datasets, tensorboardX and array-record
unimportable and ml-collections importable only from the carried wheels' `.site`. A killed
run keeps the rows that finished.
"""
# pylint: disable=protected-access

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "experiments", "accelerator_check.sh")
BASH = shutil.which("bash")
NOT_ON_THE_DEVICE = ("grain", "tensorflow_datasets", "tensorboardX", "array_record", "tensorflow")
CARRIED = ("ml_collections",)  # experiments/device_wheels.txt

DEVICE_SITECUSTOMIZE = textwrap.dedent(f'''
    """This Python as on the GPU machine: no data pipeline; carried packages only from .site."""
    import importlib.abc, importlib.machinery, os, sys

    ABSENT, CARRIED = {NOT_ON_THE_DEVICE!r}, {CARRIED!r}
    SITE = os.environ.get("DEVICE_SITE", "")

    class DeviceFinder(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in ABSENT:
          raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU machine)", name=name)
        if name in CARRIED:
          spec = importlib.machinery.PathFinder.find_spec(name, [SITE]) if SITE else None
          if spec is None:
            raise ModuleNotFoundError(f"No module named {{name!r}} (carried in .whl only)", name=name)
          return spec
        return None

    sys.meta_path.insert(0, DeviceFinder())
''')


@pytest.fixture
def device_env(tmp_path):
  """Factory: the environment of a check run as on the GPU machine (`site`: the carried
  packages' folder, None: nothing carried), its JSON under tmp_path/out."""
  folder = tmp_path / "device_python"
  folder.mkdir()
  (folder / "sitecustomize.py").write_text(DEVICE_SITECUSTOMIZE)

  def make(site=None, **extra):
    env = subprocess_env(PYTHON=sys.executable, PYTHONPATH=str(folder), OUT=str(tmp_path / "out"),
                         ACCELERATOR_CHECK_WHEELS=str(tmp_path / "no_wheels"),
                         ACCELERATOR_CHECK_SITE=str(site or tmp_path / "empty_site"),
                         DEVICE_SITE=str(site or ""), **extra)
    return env

  return make


def run_script(env, timeout=120):
  return subprocess.run([BASH, SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=timeout)


def lines(text: str) -> list[str]:
  return [line for line in text.splitlines() if line.strip()]


# Failing loudly.

def test_a_python_that_cannot_import_jax_fails_in_one_line(tmp_path):
  isolated = tmp_path / "python3"  # a real Python, without its site-packages (so without jax)
  isolated.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
  isolated.chmod(0o755)
  done = run_script(dict(os.environ, PYTHON=str(isolated)))
  assert done.returncode == 2, done
  assert lines(done.stdout) == [f"accelerator_check: FAIL: jax cannot be imported by {isolated}: "
                                "ModuleNotFoundError: No module named 'jax'"]
  nowhere = tmp_path / "empty"
  nowhere.mkdir()
  done = run_script({"PATH": str(nowhere), "HOME": os.environ.get("HOME", "/")})
  assert done.returncode == 2 and lines(done.stdout) == [
      "accelerator_check: FAIL: no 'python3' on PATH (set PYTHON=/path/to/python)"], done


def _system_python_lacks_jax() -> bool:
  python = "/usr/bin/python3"
  return os.path.exists(python) and subprocess.run(
      [python, "-c", "import jax"], capture_output=True, env={"PATH": "/usr/bin:/bin"}).returncode != 0


@pytest.mark.skipif(not _system_python_lacks_jax(), reason="needs a /usr/bin/python3 without jax")
def test_the_system_python_without_jax_fails():
  """The issue's command: `env PATH=/usr/bin:/bin bash experiments/accelerator_check.sh`."""
  done = subprocess.run(["env", "PATH=/usr/bin:/bin", "bash", "experiments/accelerator_check.sh"],
                        cwd=REPO, capture_output=True, text=True, timeout=60)
  assert done.returncode != 0
  assert len(lines(done.stdout)) == 1 and done.stdout.startswith(
      "accelerator_check: FAIL: jax cannot be imported by /usr/bin/python3")


def test_a_library_that_cannot_import_fails_in_one_line(device_env):
  """As on the GPU machine without the carried wheels: ml-collections is missing."""
  done = run_script(device_env(ACCELERATOR_CHECK_PLATFORM="cpu"))
  assert done.returncode == 2, done
  first, last = lines(done.stdout)  # the version report, then the failure
  assert first.startswith("accelerator_check: jax ") and first.endswith("; missing: none")
  assert last == ("accelerator_check: FAIL: the library cannot be imported: ModuleNotFoundError: "
                  "No module named 'ml_collections' (carried in .whl only)"), done


def test_without_an_accelerator_it_says_so_and_exits_0(tmp_path):
  env = subprocess_env(OUT=str(tmp_path / "out"), PYTHON=sys.executable,
                       ACCELERATOR_CHECK_SITE=str(tmp_path / "site"))
  env.pop("ACCELERATOR_CHECK_PLATFORM", None)
  done = run_script(env)  # the script unsets JAX_PLATFORMS: jax looks for every accelerator
  assert done.returncode == 0, done
  out = lines(done.stdout)
  assert len(out) == 2, out
  assert out[0].startswith("accelerator_check: jax ") and "; missing: none" in out[0]
  assert out[1] == "accelerator_check: no GPU or TPU here (jax devices: cpu); nothing to check."
  assert not (tmp_path / "out" / "accelerator_check.json").exists()


def test_a_visible_gpu_that_jax_does_not_start_fails(monkeypatch):
  from experiments import accelerator_check  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  monkeypatch.setattr(accelerator_check, "visible_hardware", lambda: [])
  _, device = accelerator_check.start(None)
  assert device is None  # jax reports no accelerator, and none is visible: nothing to check
  monkeypatch.setattr(accelerator_check, "visible_hardware", lambda: ["/dev/nvidia0"])
  with pytest.raises(accelerator_check.CannotStart) as error:
    accelerator_check.start(None)
  message = str(error.value)
  assert message.startswith("/dev/nvidia0 present but jax starts no accelerator backend (cuda: ")
  assert "\n" not in message
  monkeypatch.setattr(accelerator_check, "visible_hardware", lambda: [])
  with pytest.raises(accelerator_check.CannotStart, match="platform tpu asked for, but jax starts "
                     "no tpu backend"):
    accelerator_check.start("tpu")  # asked for one jax does not have


def test_failed_rows_exit_1_with_one_line_and_are_in_the_json(tmp_path, monkeypatch, capsys):
  from experiments import accelerator_check  # pylint: disable=import-outside-toplevel
  bad = {"pattern": "sliding(32)", "impl": "gpu", "dtype": "bfloat16", "shape": [1, 96, 2, 16],
         "o": 0.5, "lse": 0.0, "grads": 0.0, "ok": False, "problems": ["o error 5.0e-01"]}
  lines_of_the_part = ['DEVICE {"device": "cpu", "platform": "cpu"}', "ROW backends " + json.dumps(bad),
                       "EXIT 0"]
  monkeypatch.setattr(accelerator_check, "attention_lines", lambda args, timeout: lines_of_the_part)
  monkeypatch.setattr(accelerator_check, "run_step", lambda name, T, args, deadline: (
      {"model": name, "seq_len": T, "error": "XlaRuntimeError: cannot compile"} if name == "ecp"
      else {"model": name, "seq_len": T, "skipped": "out of time"}))
  out = tmp_path / "check.json"
  assert accelerator_check.main(["--platform=cpu", f"--out={out}"]) == accelerator_check.EXIT_FAILED
  last = lines(capsys.readouterr().out)[-1]
  assert last.startswith("accelerator_check: FAIL: 2 failed: backends sliding(32) gpu bfloat16")
  assert last.endswith(f"(and 1 more in {out})")
  summary = json.loads(out.read_text())
  assert summary["status"] == "failed" and summary["skipped"] == 5 and summary["backends"] == [bad]
  assert summary["failures"][1] == "train step ecp T=256: XlaRuntimeError: cannot compile"
  assert summary["versions"]["jax"] and summary["versions"]["missing"] == []
  # The attention part's process dying before it names a device: one line, status 2.
  monkeypatch.setattr(accelerator_check, "attention_lines", lambda args, timeout: ["EXIT -9"])
  assert accelerator_check.main(["--platform=cpu", f"--out={out}"]) == 2
  assert lines(capsys.readouterr().out)[-1] == ("accelerator_check: FAIL: the attention checks' "
                                                "process exited with -9 before naming a device")


def test_the_attention_part_streams_its_rows(monkeypatch, capsys):
  """The child side: `DEVICE`, then a `ROW` line per row, as each is emitted."""
  from experiments import accelerator_backends, accelerator_check  # pylint: disable=import-outside-toplevel
  row = {"call": "dense causal", "shape": [1, 128, 2, 64], "ok": True, "problems": []}
  monkeypatch.setattr(accelerator_backends, "backend_rows", lambda platform, quick, emit: None)
  monkeypatch.setattr(accelerator_backends, "cudnn_rows", lambda platform, quick, emit: emit(row))
  monkeypatch.setattr(accelerator_backends, "cudnn_aot_rows", lambda quick, emit: None)
  assert accelerator_check.main(["--part=attention", "--platform=cpu"]) == 0
  assert lines(capsys.readouterr().out) == ['DEVICE {"device": "cpu", "platform": "cpu"}',
                                            "ROW cudnn " + json.dumps(row)]
  assert accelerator_check.main(["--part=attention", "--platform=cpu", "--steps_only"]) == 0
  assert lines(capsys.readouterr().out) == ['DEVICE {"device": "cpu", "platform": "cpu"}']


def test_the_summary_is_complete_json_after_every_row(tmp_path):
  from experiments.accelerator_check import Summary  # pylint: disable=import-outside-toplevel
  path = tmp_path / "sub" / "check.json"
  summary = Summary(str(path), device="cpu")
  assert json.loads(path.read_text()) == {"status": "running", "device": "cpu"}
  for i in range(3):
    summary.add("rows", {"i": i})
    assert json.loads(path.read_text())["rows"] == [{"i": j} for j in range(i + 1)]
  summary.set(status="passed")
  assert json.loads(path.read_text())["status"] == "passed"
  assert os.listdir(path.parent) == ["check.json"]  # no temp file left


def test_train_steps_past_the_budget_are_skipped_unstarted():
  from experiments import accelerator_check  # pylint: disable=import-outside-toplevel
  row = accelerator_check.run_step("dense", 4096, None, deadline=time.time() + 5)
  assert row == {"model": "dense", "seq_len": 4096, "skipped": "out of time"}


def test_a_train_step_that_fails_is_an_error_row():
  done = subprocess.run([sys.executable, "-m", "experiments.accelerator_step", "--model=dense",
                         "--seq_len=64", "--d_model=30", "--num_heads=4", "--num_layers=1",
                         "--vocab_size=64"], cwd=REPO, capture_output=True, text=True,
                        env=subprocess_env(JAX_PLATFORMS="cpu"), timeout=300)
  assert done.returncode == 1, done
  row = json.loads(done.stdout.strip().splitlines()[-1].removeprefix("ROW "))
  assert row["model"] == "dense" and "d_model" in row["error"] and "\n" not in row["error"], row


def test_the_check_imports_no_data_pipeline(device_env, tmp_path):
  """What the check imports, under the GPU machine's absences (ml-collections from here)."""
  site = tmp_path / "site"
  shutil.copytree(os.path.dirname(importlib.util.find_spec("ml_collections").origin),
                  site / "ml_collections")
  code = ("import sys; from experiments import accelerator_check, accelerator_backends, "
          "accelerator_step; accelerator_check.start('cpu'); "
          "accelerator_step.config_for('ecp', 256, type('A', (), dict(vocab_size=512, d_model=64, "
          "num_layers=2, num_heads=2))); "
          f"print(sorted(m for m in sys.modules if m.split('.')[0] in {NOT_ON_THE_DEVICE!r}))")
  done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=device_env(site), text=True,
                        capture_output=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip().splitlines()[-1] == "[]"


# The whole path.

@pytest.mark.slow  # downloads the carried wheels (PyPI), then every row at tiny sizes: 2-3 min
def test_the_whole_check_on_cpu_as_on_the_gpu_machine(device_env, tmp_path):
  wheels = tmp_path / "wheels"
  built = subprocess.run([BASH, os.path.join(REPO, "experiments", "device_wheels.sh"), str(wheels)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
  assert built.returncode == 0, built.stdout + built.stderr
  names = sorted(p.name for p in wheels.iterdir())
  assert [n.split("-")[0] for n in names] == ["ml_collections"], names
  assert sum(p.stat().st_size for p in wheels.iterdir()) < 64 * 2**20
  site = tmp_path / "site"
  env = device_env(site, ACCELERATOR_CHECK_PLATFORM="cpu")
  env["ACCELERATOR_CHECK_WHEELS"] = str(wheels)
  done = run_script(env, timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert (site / "ml_collections" / "__init__.py").exists()  # installed from the wheel
  out = lines(done.stdout)
  assert out[0].startswith("accelerator_check: jax ") and out[0].endswith("; missing: none")
  assert out[-1].startswith("accelerator_check: passed in ")
  summary = json.loads((tmp_path / "out" / "accelerator_check.json").read_text())
  assert summary["status"] == "passed" and summary["failures"] == [] and summary["skipped"] == 0
  backends = summary["backends"]
  assert {r["impl"] for r in backends} == {"gpu", "splash", "xla"} and all(r["ok"] for r in backends)
  assert {r["dtype"] for r in backends} == {"float32", "bfloat16"}
  assert len(summary["cudnn"]) == 3 and all(r["ok"] and r["o"] < 3e-2 for r in summary["cudnn"])
  steps = {r["model"]: r for r in summary["train_steps"]}
  # the models the device check times (accelerator_step.MODELS: a subset on purpose, the
  # device's minutes; the rows' config paths are the step's own)
  from experiments import accelerator_step  # pylint: disable=import-outside-toplevel
  assert set(steps) == set(accelerator_step.MODELS)
  for name, r in steps.items():
    assert r["tokens_per_sec"] > 0 and r["estimate_bytes"] > 0 and r["model_tflop"] > 0, r
    assert (name == "dense") == ("vs_dense" not in r)


def test_a_killed_run_keeps_the_rows_that_finished(tmp_path):
  """(5 s: the check's first rows, then SIGKILL to it and its children)"""
  out = tmp_path / "check.json"
  process = subprocess.Popen([sys.executable, "-m", "experiments.accelerator_check",
                              "--platform=cpu", f"--out={out}"], cwd=REPO,
                             env=subprocess_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
  try:
    deadline = time.time() + 300
    while time.time() < deadline:
      if out.exists() and len(json.loads(out.read_text()).get("backends", [])) >= 2:
        break
      time.sleep(0.2)
  finally:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
  summary = json.loads(out.read_text())
  assert summary["status"] == "running" and len(summary["backends"]) >= 2
  assert all(r["ok"] for r in summary["backends"])


# The kernels a compiled module calls.

def test_kernel_kinds_classifies_custom_call_targets():
  from efficient_lm.training.step_memory import kernel_counts, kernel_kinds  # pylint: disable=import-outside-toplevel
  text = "\n".join([
      '%a = custom-call(%q), custom_call_target="__cudnn$fmhaSoftmax"',
      '%b = custom-call(%q), custom_call_target="__cudnn$fmhaSoftmaxBackward"',
      '%c = custom-call(%q), custom_call_target="__gpu$xla.gpu.triton"',
      '%d = custom-call(%q), custom_call_target="tpu_custom_call"',
      '%e = custom-call(%q), custom_call_target="Sharding"'])
  assert kernel_kinds(text) == {"cudnn": 2, "triton": 1, "tpu": 1}
  assert kernel_kinds("") == {"cudnn": 0, "triton": 0, "tpu": 0}
  assert kernel_counts(text) == {"cudnn a": 1, "cudnn b": 1, "d": 1, "triton c": 1}


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed: pip install -e '.[tpu]'")
def test_kernel_kinds_counts_splash_compiled_for_a_tpu():
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from efficient_lm.parallel import targets  # pylint: disable=import-outside-toplevel
  from efficient_lm.ops import core  # pylint: disable=import-outside-toplevel
  from efficient_lm.ops.pattern import Pattern  # pylint: disable=import-outside-toplevel
  from efficient_lm.training.step_memory import kernel_kinds  # pylint: disable=import-outside-toplevel
  target = targets.load("tpu:v5e:1x1")
  mesh = jax.sharding.Mesh(np.array(target.devices), ("data",))
  spec = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16,
                              sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  loss = lambda q, k, v: jnp.sum(core.attend(q, k, v, Pattern.sliding(256), impl="splash",
                                             with_lse=False)[0].astype(jnp.float32))
  with jax.set_mesh(mesh):
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile().as_text()
  assert kernel_kinds(text) == {"cudnn": 0, "triton": 0, "tpu": 3}  # forward, dk / dv, dq
