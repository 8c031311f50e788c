"""Compiling for accelerators from this CPU host: `--compile_only --target=<platform>:<device>:<topology>`.

TPU targets need libtpu (the `tpu` extra, which CI installs); GPU targets the
CUDA plugin (the `gpu` extra, or a folder holding it named by
$EFFICIENT_LM_CUDA_PLUGIN, which keeps its start-up lines out of every other
test). A test whose extra is missing is skipped and says which.
"""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, build, load_config
from efficient_lm.parallel import sharding, targets
from efficient_lm.state import train_state
from efficient_lm.training import prepare as config_check, step_memory

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_tpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed: pip install -e '.[tpu]'")
CUDA_PLUGIN = os.environ.get("EFFICIENT_LM_CUDA_PLUGIN", "")


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package (`jax_plugins`) is missing
    return False


HAS_CUDA_PLUGIN = _installed("jax_plugins.xla_cuda12") or _installed("jax_plugins.xla_cuda13") or bool(
    CUDA_PLUGIN and os.path.isdir(os.path.join(CUDA_PLUGIN, "jax_plugins")))
HAS_CUDNN = _installed("nvidia.cudnn") or bool(  # jax[cuda12] brings it; a bare plugin folder may not
    CUDA_PLUGIN and os.path.isdir(os.path.join(CUDA_PLUGIN, "nvidia", "cudnn")))


def small(name: str, preset: str | None = None, *, seq_len: int = 2048, batch_size: int = 4,
          chunk: int = 512, **model):
  """A small config of `name` at `seq_len` with the long-context settings (sequence chunks where
  the family has them), the config's own mesh (fsdp over every device)."""
  config = load_config(name, preset)
  config.mesh.fsdp = -1
  config.data.update(seq_len=seq_len, batch_size=batch_size, vocab_size=512)
  config.model.update({"d_model": 64, "num_layers": 2, "num_heads": 2, "remat": "block", **model})
  config.train.loss_chunk = chunk
  if config.model.get("seq_chunk", 0):
    config.model.seq_chunk = chunk
  if name == "ecp":
    config.model.num_segments = seq_len // 256
  if name == "bcmt":
    config.model.block_size = 256
  if name == "perceiver_ar":
    config.model.num_latents = 256
  return config


def compile_for(config, spec: str, num_slices: int = 1):
  """(report, compiled) of the config's train step compiled for `spec`."""
  target = targets.load(spec, num_slices)
  run = config_check.validate(build(config), target.devices)
  mesh = sharding.make_mesh(run.mesh, target.devices)
  built = train_state.build(run, mesh, abstract=True)
  compiled = step_memory.compile_train_step(run, built)
  return step_memory.report(compiled, run, built, target), compiled


def test_bad_targets_are_one_line_errors():
  for spec, match in [("v5e:2x2", "must be <platform>:<device>:<topology>"),
                      ("npu:v5e:2x2", "platform 'npu' is not one of tpu, gpu"),
                      ("tpu:v9z:2x2", "no TPU 'v9z' known here; use one of v5e, v5p, v6e"),
                      ("gpu:h100:eight", "topology 'eight' must be dimensions"),
                      ("gpu:k80:1x1x1", "no GPU 'k80' known here; use one of a100, h100, h200")]:
    with pytest.raises(targets.TargetError, match=re.escape(match)):
      targets.parse(spec)


def test_the_extra_and_the_topology_are_checked_before_the_plugin_loads(tmp_path):
  """`targets.check` answers from the spec and the installed packages alone: a TPU topology with
  the wrong number of dimensions, a platform whose extra is missing. The command line says it in
  one line before jax's backends or the plugin start."""
  with pytest.raises(targets.TargetError, match=r"v5e slice's topology has 2 dimensions"):
    targets.check("tpu:v5e:2x2x1")
  with pytest.raises(targets.TargetError, match=r"v5p slice's topology has 3 dimensions"):
    targets.check("tpu:v5p:2x2")
  if not HAS_CUDA_PLUGIN:
    with pytest.raises(targets.TargetError, match=r"needs the CUDA PJRT plugin .*\[gpu\]"):
      targets.check("gpu:h100:1x1x8")
  if not HAS_LIBTPU:
    with pytest.raises(targets.TargetError, match=r"needs libtpu .*\[tpu\]"):
      targets.check("tpu:v5e:2x2")
  done = subprocess.run([sys.executable, "-m", "efficient_lm.main", "--config=configs/dense.py",
                         "--compile_only", "--target=tpu:v5e:4x4x4", f"--workdir={tmp_path}/w"],
                        capture_output=True, text=True, cwd=REPO, timeout=300)
  assert done.returncode == 2 and done.stderr.strip().splitlines() == [
      "error: --target='tpu:v5e:4x4x4': a v5e slice's topology has 2 dimensions (chips along "
      "each axis), e.g. v5e:2x2 or 4x8"], done.stderr


def test_gpu_descriptions_ship_with_the_package():
  assert set(targets.gpu_devices()) >= {"a100", "h100", "h200"}
  text = targets.gpu_description("h200")
  memory = int(re.search(r"device_memory_size:\s*(\d+)", text).group(1))
  assert 140e9 < memory < 152e9 and "cuda_compute_capability { major: 9 minor: 0 }" in text


@pytest.mark.slow  # two TPU compiles: ~25 s
@needs_tpu
def test_the_report_names_the_kernels_and_the_fallbacks(monkeypatch):
  """A TPU compile lists the attention kernels of its module by name (the splash forward, dq and
  dkv) and their tiles as traced, and no fallback; a call the kernel refuses is listed with its
  reason, and the human line counts both."""
  from efficient_lm.ops.core import splash  # pylint: disable=import-outside-toplevel
  config = small("dense", seq_len=1024, batch_size=4, chunk=1024)
  report, _ = compile_for(config, "tpu:v5e:2x2")
  names = report["attention_kernels"]
  assert any("splash_mha_fwd" in n for n in names) and any("splash_mha_dq" in n for n in names)
  assert report["attention_fallbacks"] == [] and report["attention_tiles"] == {
      "splash: 512x512 tiles": 1}
  assert f"attention: {sum(names.values())} kernel calls" in step_memory.describe(report)
  monkeypatch.setattr(splash, "BACKEND", dataclasses.replace(
      splash.BACKEND, unsupported=lambda call: "refused for the test"))
  refused, _ = compile_for(small("dense", seq_len=1024, batch_size=4, chunk=1024), "tpu:v5e:2x2")
  assert refused["attention_kernels"] == {}
  assert refused["attention_fallbacks"] == [
      {"backend": "splash", "reason": "refused for the test", "calls": 1}]
  assert "0 kernel calls, 1 fallbacks (1 on splash: refused for the test)" in step_memory.describe(
      refused)


@pytest.mark.slow
@needs_tpu
def test_tpu_step_report_uses_the_platform_figure():
  """On TPU the figure is the program's peak plus code (not the sum of the analysis' sizes: its
  temporaries overstate what a large step allocates), the JSON names the target and the chip's
  memory, and collectives are counted (fsdp=4: weights gathered)."""
  report, _ = compile_for(small("pi_attention", seq_len=4096, chunk=1024), "tpu:v5e:2x2")
  assert report["target"] == "tpu:v5e:2x2" and report["platform"] == "tpu"
  assert report["num_devices"] == 4 and report["mesh"]["fsdp"] == 4
  assert report["per_device_total_bytes"] == (report["per_device_peak_bytes"]
                                              + report["per_device_code_bytes"])
  assert report["device_memory_bytes"] == 16 * 2**30
  assert report["per_device_available_bytes"] == int(15.75 * 2**30) and report["fits"]
  assert report["collectives"]["all-gather"] > 0
  assert set(report["collectives"]) == set(step_memory.COLLECTIVES)


def _padding(dims: list[int], layout: str) -> float:
  """How much larger than its elements an array of `dims` is in a TPU tiled `layout`
  ('minor-to-major:T(8,128)(2,1)...')."""
  m = re.match(r"([\d,]*):T\((\d+),(\d+)\)(?:\((\d+),(\d+)\))?", layout)
  if not m or len(dims) < 2:
    return 1.0
  order = [int(x) for x in m.group(1).split(",")]
  rows, lanes = int(m.group(2)), int(m.group(3))
  rows *= int(m.group(4)) if m.group(4) else 1  # 16-bit / 8-bit values pack several rows
  minor, second = dims[order[0]], dims[order[1]]
  return (-(-minor // lanes) * lanes) * (-(-second // rows) * rows) / (minor * second)


@pytest.mark.slow  # a TPU compile of a 16K step: ~20 s
@needs_tpu
def test_no_sequence_wide_buffer_is_padded_on_tpu():
  """The sequence-chunked block keeps its sequence-wide arrays lane-dense: no array of at least
  half a [B, T, D] activation is padded by the TPU's (8, 128) tiles (heads of width 32 would be
  4x), while the chunks' own [.., H, K] arrays may be."""
  T, D = 16384, 128  # a lane-wide residual stream; heads of width 32
  report, compiled = compile_for(small("pi_attention", seq_len=T, chunk=2048, d_model=D,
                                       num_heads=4), "tpu:v5e:2x2")
  local_batch = 1  # B=4 over fsdp=4
  big = local_batch * T * D // 2
  padded = []
  for m in re.finditer(r"\b(?:f32|bf16)\[([\d,]+)\]\{([^}]*)\}", compiled.as_text()):
    dims = [int(d) for d in m.group(1).split(",")]
    if eval("*".join(map(str, dims))) >= big and _padding(dims, m.group(2)) > 1.01:
      padded.append(m.group(0))
  assert not padded, sorted(set(padded))[:5]
  assert report["fits"]


@pytest.mark.slow
@needs_tpu
@pytest.mark.parametrize("name,preset", [
    ("bcmt", None), ("dense", None), ("sliding_window", None), ("bcmt", "honly"), ("ecp", None),
    ("perceiver_ar", None), ("pi_attention", "doubling"), ("gated_deltanet", None)])
def test_every_family_compiles_for_a_tpu_slice(name, preset):
  """Every family's real train step compiles for v5e:2x2 and, having compiled, is never refused."""
  report, _ = compile_for(small(name, preset), "tpu:v5e:2x2")
  assert report["fits"] and report["per_device_total_bytes"] <= report["per_device_available_bytes"]
  assert report["platform"] == "tpu" and report["collectives"]["all-gather"] > 0


@pytest.mark.slow  # a TPU compile: ~30 s
@needs_tpu
def test_gated_deltanet_hybrid_reports_its_state_scan_and_attention_kernels():
  """Gated DeltaNet with a sliding-window layer every 2nd: on a TPU the recurrence's state scan is
  its Pallas kernel (`recurrent_impl='auto'`), named in the report with the hybrid layer's splash
  kernels, and nothing falls back."""
  report, _ = compile_for(small("gated_deltanet", "hybrid", hybrid_every=2), "tpu:v5e:2x2")
  names = report["attention_kernels"]
  assert "gated_delta_state_scan_fwd" in names and "gated_delta_state_scan_bwd" in names, names
  assert any("splash_mha_fwd" in n for n in names), names
  assert report["attention_fallbacks"] == [] and report["fits"]


@pytest.mark.slow  # the command line in a subprocess, compiling for a TPU slice: ~30 s
@needs_tpu
def test_compile_only_target_command_line(tmp_path):
  """The command line: the last stdout line is the JSON report; nothing is written; a step the
  target cannot hold exits 3 with one line naming the fixes."""
  base = [sys.executable, "-m", "efficient_lm.main", "--config=configs/pi_attention.py",
          "--compile_only", "--target=tpu:v5e:2x2", f"--workdir={tmp_path / 'w'}",
          "--config.model.d_model=64", "--config.model.num_heads=2", "--config.data.vocab_size=512",
          f"--config.data.data_dir={tmp_path / 'd'}"]
  env = dict(os.environ)
  ok = subprocess.run(base + ["--config.data.seq_len=1024", "--config.data.batch_size=4"],
                      capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
  assert ok.returncode == 0, ok.stderr[-2000:]
  report = json.loads(ok.stdout.strip().splitlines()[-1])
  assert report["target"] == "tpu:v5e:2x2" and report["fits"] and report["num_devices"] == 4
  assert not (tmp_path / "w").exists() and not (tmp_path / "d").exists()
  # libtpu's probe for local chips and a cache entry a compile-only client cannot read: kept out
  assert "TPU_ACCELERATOR_TYPE" not in ok.stderr and "InitGoogle" not in ok.stderr, ok.stderr[-2000:]
  assert "persistent compilation cache" not in ok.stderr, ok.stderr[-2000:]
  # Dense in its [T, T] form at 64K tokens: 16 GiB of scores per head and sequence.
  big = subprocess.run(base[:3] + ["--config=configs/dense.py"] + base[4:] + [
      "--config.data.seq_len=65536", "--config.data.batch_size=4",
      "--config.model.attention_impl=reference"], capture_output=True, text=True, cwd=REPO,
      env=env, timeout=600)
  assert big.returncode == 3, big.stderr[-2000:]
  errors = [line for line in big.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "does not fit" in errors[0] and "model.attention_impl='xla'" in errors[0]
  bad = subprocess.run(base[:5] + ["--target=tpu:v5e"], capture_output=True, text=True,
                       cwd=REPO, env=env, timeout=600)
  assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: --target=")


@pytest.mark.slow
@needs_tpu
def test_two_slices_make_a_hybrid_mesh():
  """--num_slices=2: the data axis runs across the slices (mesh.dcn_data=-1 takes them), fsdp
  inside each; the step compiles for both slices' 8 chips."""
  config = small("pi_attention")
  config.data.batch_size = 8
  report, _ = compile_for(config, "tpu:v5e:2x2", num_slices=2)
  assert report["num_devices"] == 8 and report["mesh"]["data"] == 2 and report["mesh"]["fsdp"] == 4
  assert report["num_slices"] == 2 and report["fits"]
  target = targets.load("tpu:v5e:2x2", 2)
  mesh = sharding.make_mesh(build(config).mesh, target.devices)
  slices = [[d.slice_index for d in mesh.devices[i].flat] for i in range(2)]
  assert slices == [[0] * 4, [1] * 4]  # each data index is one whole slice


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="the CUDA plugin is not installed: pip install -e "
                    "'.[gpu]' (or point $EFFICIENT_LM_CUDA_PLUGIN at a folder holding it)")
def test_compile_only_for_a_gpu_target(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if CUDA_PLUGIN:
    env["PYTHONPATH"] = os.pathsep.join([CUDA_PLUGIN, REPO])
  args = [sys.executable, "-m", "efficient_lm.main", "--config=configs/sliding_window.py",
          "--compile_only", "--target=gpu:h100:1x1x2", "--config.model.d_model=64",
          "--config.model.num_heads=2", "--config.data.vocab_size=512", "--config.data.seq_len=2048",
          "--config.data.batch_size=2", "--config.model.dtype=bfloat16"]
  result = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report["target"] == "gpu:h100:1x1x2" and report["platform"] == "gpu"
  assert report["num_devices"] == 2 and report["fits"]
  assert report["device_memory_bytes"] == 81559 * 2**20
  assert report["per_device_available_bytes"] == int(0.75 * 81559 * 2**20)
  assert report["attention_fallbacks"] == [] and report["attention_kernels"]  # the Triton kernel
  # Dense in bfloat16 trains on cuDNN (no document ids: cuDNN takes none), reported by name; without
  # the cuDNN library installed, on the Triton kernel (one log line says why).
  dense = subprocess.run(args[:3] + ["--config=configs/dense.py"] + args[4:] + [
      "--config.data.document_mask=False"], capture_output=True, text=True, cwd=REPO, env=env,
      timeout=600)
  assert dense.returncode == 0, dense.stderr[-2000:]
  report = json.loads(dense.stdout.strip().splitlines()[-1])
  kernel = "cudnn" if HAS_CUDNN else "triton"
  assert any(kernel in name for name in report["attention_kernels"]), report["attention_kernels"]
  assert report["attention_fallbacks"] == []


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="the CUDA plugin is not installed: pip install -e "
                    "'.[gpu]' (or point $EFFICIENT_LM_CUDA_PLUGIN at a folder holding it)")
def test_gated_deltanet_compiles_for_a_gpu_target():
  """Gated DeltaNet for two H100s from this host: no attention (its recurrence runs on `xla`), and
  its hybrid's sliding-window layers on the Triton kernel, nothing falling back."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if CUDA_PLUGIN:
    env["PYTHONPATH"] = os.pathsep.join([CUDA_PLUGIN, REPO])
  reports = {}
  for spec in ("configs/gated_deltanet.py", "configs/gated_deltanet.py:hybrid"):
    result = subprocess.run(
        [sys.executable, "-m", "efficient_lm.main", f"--config={spec}", "--compile_only",
         "--target=gpu:h100:1x1x2", "--config.model.d_model=64", "--config.model.num_heads=2",
         "--config.data.vocab_size=512", "--config.data.seq_len=2048", "--config.data.batch_size=2",
         "--config.model.dtype=bfloat16"], capture_output=True, text=True, cwd=REPO, env=env,
        timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    reports[spec] = json.loads(result.stdout.strip().splitlines()[-1])
  plain, hybrid = reports.values()
  assert plain["platform"] == "gpu" and plain["fits"] and plain["attention_kernels"] == {}
  assert any("triton" in name for name in hybrid["attention_kernels"]), hybrid["attention_kernels"]
  assert plain["attention_fallbacks"] == hybrid["attention_fallbacks"] == []


@needs_tpu
def test_training_on_a_tpu_reports_mfu():
  """The training loop's progress on an accelerator: the step's model FLOPs from the config and
  the devices' peak (4 v5e chips: 4 x 197 TFLOP/s); nothing on a CPU."""
  import types  # pylint: disable=import-outside-toplevel
  from efficient_lm.training import flops, loop as train  # pylint: disable=import-outside-toplevel
  run_config = build(small("pi_attention", seq_len=1024))
  target = targets.load("tpu:v5e:2x2")
  mesh = sharding.make_mesh(run_config.mesh, target.devices)
  run = types.SimpleNamespace(mesh=mesh, config=run_config,
                              built=types.SimpleNamespace(num_params=10**6))
  got = train.utilisation(run)
  assert got["peak_flops"] == 4 * 197e12 and got["num_devices"] == 4
  assert got["step_flops"] == flops.step_flops(run_config, 10**6)
  # A model without attention (its recurrence counted instead) and one whose FLOPs are not
  # counted (no MFU; the line keeps tokens/s per device).
  for name, counted in (("gated_deltanet", True), ("perceiver_ar", False)):
    other = types.SimpleNamespace(mesh=mesh, config=build(small(name, seq_len=1024)),
                                  built=run.built)
    step_flops = train.utilisation(other)["step_flops"]
    assert (step_flops > 6 * 10**6 * 1024 * 4) if counted else step_flops is None, name
  cpu = types.SimpleNamespace(mesh=sharding.make_mesh(run_config.mesh), config=run_config,
                              built=None)
  assert train.utilisation(cpu) == {}
