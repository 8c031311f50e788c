"""Accelerator targets: compile for a TPU slice or GPUs from any host, with nothing run.

    target = targets.load("tpu:v5e:2x2")            # or "gpu:h100:1x1x8", num_slices=2
    mesh = sharding.make_mesh(config.mesh, devices=target.devices)

A target is `<platform>:<device>:<topology>`. TPU topologies are the chips of
a slice (`2x2`, `2x2x1`; libtpu, the `tpu` extra, describes them); GPU ones
are slices x hosts x GPUs per host (`1x1x8`), from a device description in
`targets/gpu/<device>.txtpb` (the CUDA PJRT plugin, the `gpu` extra, compiles
for it). `num_slices` adds slices joined by the data-center network. The
devices are compile-only: the real compiler runs and reports memory per chip,
nothing executes, so this measures memory and proves kernels compile, never
speed.
"""

import dataclasses
import functools
import importlib.resources
import importlib.util
import os
import re

import jax

from efficient_lm.runtime import jax_compat
from efficient_lm.runtime import jax_devices

PLATFORMS = ("tpu", "gpu")

# TPU chips: HBM per chip, and what libtpu lets one program use (its "available HBM",
# read from its out-of-memory error on a compile for each chip).
TPU_CHIPS = {
    "v5e": dict(memory=16 * 2**30, available=int(15.75 * 2**30), peak_bf16_tflops=197),
    "v5p": dict(memory=96 * 2**30, available=int(95.74 * 2**30), peak_bf16_tflops=459),
    "v6e": dict(memory=32 * 2**30, available=int(31.25 * 2**30), peak_bf16_tflops=918),
}
# GPUs with a description in targets/gpu/: dense bfloat16 peak (vendor figures, for MFU).
GPU_PEAK_BF16_TFLOPS = {"a100": 312, "h100": 989, "h200": 989}
GPU_MEMORY_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION's default: what a jax process takes


class TargetError(ValueError):
  """A `--target` that cannot be compiled for here; the message says why and what to install."""


@dataclasses.dataclass(frozen=True)
class Target:
  spec: str               # e.g. "tpu:v5e:2x2"
  platform: str           # "tpu" or "gpu"
  device: str             # "v5e", "h100", ...
  topology: str           # "2x2", "1x1x8"
  num_slices: int
  devices: tuple          # compile-only jax devices, every slice's
  device_kind: str
  memory_bytes: int       # the device's memory
  available_bytes: int    # what one program may use on it (the fit check's budget)
  peak_bf16_tflops: float

  def describe(self) -> str:
    slices = f" x {self.num_slices} slices" if self.num_slices > 1 else ""
    return (f"{self.spec}{slices}: {len(self.devices)} x {self.device_kind}, "
            f"{self.available_bytes / 2**30:.2f} GiB usable per device")


def gpu_devices() -> tuple[str, ...]:
  """The GPU names with a shipped description."""
  folder = importlib.resources.files("efficient_lm.parallel.targets") / "gpu"
  return tuple(sorted(p.name[:-len(".txtpb")] for p in folder.iterdir()
                      if p.name.endswith(".txtpb")))


def gpu_description(device: str) -> str:
  """The text of `targets/gpu/<device>.txtpb` (a GpuTargetConfigProto)."""
  return (importlib.resources.files("efficient_lm.parallel.targets") / "gpu"
          / f"{device}.txtpb").read_text()


def parse(spec: str) -> tuple[str, str, str]:
  """(platform, device, topology) of '<platform>:<device>:<topology>'; TargetError if malformed."""
  parts = spec.split(":") if isinstance(spec, str) else []
  if len(parts) != 3 or not all(parts):
    raise TargetError(f"--target={spec!r} must be <platform>:<device>:<topology>, e.g. tpu:v5e:2x2 "
                      "or gpu:h100:1x1x8")
  platform, device, topology = (p.strip().lower() for p in parts)
  if platform not in PLATFORMS:
    raise TargetError(f"--target={spec!r}: platform {platform!r} is not one of "
                      f"{', '.join(PLATFORMS)}")
  if not re.fullmatch(r"\d+(x\d+){1,2}", topology):
    raise TargetError(f"--target={spec!r}: topology {topology!r} must be dimensions such as 2x2, "
                      "2x2x1 (TPU chips) or 1x1x8 (GPU slices x hosts x GPUs per host)")
  known = tuple(TPU_CHIPS) if platform == "tpu" else gpu_devices()
  if device not in known:
    raise TargetError(f"--target={spec!r}: no {platform.upper()} {device!r} known here; use one of "
                      f"{', '.join(known)}")
  return platform, device, topology


# The extra each platform needs, and how to tell it is installed without loading it.
EXTRAS = {"tpu": ("libtpu", "libtpu", "pip install -e '.[tpu]' (jax[tpu] at this jax version)"),
          "gpu": ("jax_plugins.xla_cuda12", "the CUDA PJRT plugin",
                  "pip install -e '.[gpu]' (jax[cuda12] at this jax version)")}
TPU_DIMENSIONS = {"v5e": 2, "v6e": 2, "v5p": 3}  # a slice's topology: chips along each axis


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package is missing
    return False


def check(spec: str) -> tuple[str, str, str]:
  """`parse`, then what this host can tell before loading any accelerator plugin: a TPU topology
  has the chip's dimensions (v5e, v6e: 2x4; v5p: 2x2x2), then the extra the platform needs is
  installed (a wrong spec is named whatever is installed). TargetError naming the fix otherwise."""
  platform, device, topology = parse(spec)
  if platform == "tpu" and topology.count("x") + 1 != TPU_DIMENSIONS[device]:
    example = {2: "2x2 or 4x8", 3: "2x2x1 or 4x4x4"}[TPU_DIMENSIONS[device]]
    raise TargetError(f"--target={spec!r}: a {device} slice's topology has "
                      f"{TPU_DIMENSIONS[device]} dimensions (chips along each axis), e.g. "
                      f"{device}:{example}")
  module, what, fix = EXTRAS[platform]
  if not _installed(module):
    raise TargetError(f"--target={spec!r} needs {what} to compile for {platform.upper()}s: {fix}")
  return platform, device, topology


def prepare_host() -> None:
  """Before jax starts its backends: this host compiles, it runs nothing on a local TPU/GPU."""
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA driver needed to compile
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")       # several compiling processes
  try:
    jax.config.update("jax_platforms", "cpu")
  except RuntimeError:  # backends already started (a test process): they are what they are
    pass


@functools.lru_cache(maxsize=None)
def load(spec: str, num_slices: int = 1) -> Target:
  """The compile-only devices of `spec`; TargetError naming the extra to install if this host
  cannot compile for it."""
  platform, device, topology = parse(spec)
  if not isinstance(num_slices, int) or num_slices < 1:
    raise TargetError(f"--num_slices={num_slices!r} must be a positive integer")
  prepare_host()
  if platform == "tpu":  # (libtpu's probe for local chips speaks on stderr: kept back)
    devices = jax_devices.quietly(lambda: _tpu_devices(spec, device, topology, num_slices))
    chip = TPU_CHIPS[device]
    memory, available, peak = chip["memory"], chip["available"], chip["peak_bf16_tflops"]
  else:
    devices = jax_devices.quietly(lambda: _gpu_devices(spec, device, topology, num_slices))
    memory = int(re.search(r"device_memory_size:\s*(\d+)", gpu_description(device)).group(1))
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION))
    available, peak = int(memory * fraction), GPU_PEAK_BF16_TFLOPS.get(device, 0)
  return Target(spec=spec, platform=platform, device=device, topology=topology,
                num_slices=num_slices, devices=tuple(devices), device_kind=devices[0].device_kind,
                memory_bytes=memory, available_bytes=available, peak_bf16_tflops=peak)


def _topologies():
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return topologies


def _tpu_devices(spec: str, device: str, topology: str, num_slices: int) -> list:
  if jax_compat.tpu_library_path() is None:
    raise TargetError(f"--target={spec!r} needs libtpu to compile for TPUs: pip install -e '.[tpu]' "
                      "(jax[tpu] at this jax version)")
  name = f"{device}:{topology}"
  dims = tuple(int(d) for d in topology.split("x"))
  kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
  try:
    return list(_topologies().get_topology_desc(topology_name=name, platform="tpu", **kwargs).devices)
  except Exception as first:  # pylint: disable=broad-except
    # A slice smaller than one host (v5e:1x1) needs its host bounds given.
    bounds = (dims + (1, 1, 1))[:3]
    try:
      return list(_topologies().get_topology_desc(topology_name=name, platform="tpu",
                                                  chips_per_host_bounds=bounds, **kwargs).devices)
    except Exception:  # pylint: disable=broad-except
      raise TargetError(f"--target={spec!r}: libtpu cannot describe topology {name!r} "
                        f"({str(first).splitlines()[0][:200]})") from first


def _gpu_devices(spec: str, device: str, topology: str, num_slices: int) -> list:
  dims = [int(d) for d in topology.split("x")]
  if len(dims) != 3:
    raise TargetError(f"--target={spec!r}: a GPU topology is <slices>x<hosts>x<gpus per host>, "
                      "e.g. 1x1x8")
  dims[0] *= num_slices
  try:
    topo = _topologies().get_topology_desc(platform="cuda", target_config=gpu_description(device),
                                           topology="x".join(map(str, dims)))
  except (NotImplementedError, RuntimeError, KeyError) as e:
    raise TargetError(f"--target={spec!r} needs the CUDA PJRT plugin to compile for GPUs: "
                      "pip install -e '.[gpu]' (jax[cuda12] at this jax version)") from e
  return list(topo.devices)


def platform_of(devices) -> str:
  """'tpu', 'gpu' or 'cpu' for a list of devices (a CUDA device's platform is 'gpu')."""
  platform = devices[0].platform
  return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


__all__ = ["Target", "TargetError", "TPU_CHIPS", "gpu_devices", "load", "parse", "platform_of",
           "prepare_host"]
