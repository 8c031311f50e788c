"""Every private jax API the library uses, in one place: jax 0.10.2 through 0.12.x.

Each entry uses jax's private function where this jax has it (with the signature the library
calls it with) and otherwise falls back, named in `missing()`:

    splash_forward / splash_bwd_dkv / splash_bwd_dq
        the TPU splash kernels' pieces (`splash_attention_kernel._splash_attention_*`).
        Fallback: `splash_missing()` says why, and the splash backend hands its calls to `xla`.
    cudnn_capability_answers(capability)
        jax's cuDNN capability checks (`jax._src.cudnn.fused_attention_stablehlo.
        check_compute_capability` / `is_cuda_compute_capability_equal`) answer for a compile
        target. Fallback: no patch (jax asks the local GPU, right on a GPU host).
    concrete_mesh()
        the mesh of `jax.set_mesh`, also while tracing (`jax._src.mesh.get_concrete_mesh`).
        Fallback: `jax.sharding.get_mesh()` outside tracing, else None.
    tpu_library_path()
        libtpu's path (`jax._src.xla_bridge.get_tpu_library_path`). Fallback: TPU_LIBRARY_PATH,
        else libtpu's own `get_library_path()`.
    classic_cpu_emitters_flag(), warns_of_full_rematerialization()
        what XLA does differently by jaxlib version: the classic CPU fusion emitters' flag (the
        tests' compile mode), which jaxlib 0.11 no longer knows (an unknown XLA_FLAGS entry
        aborts the process); the partitioner's rematerialization warning, gone in 0.11.

`report()` names the versions and anything missing in one line (the device check's first step).
jax is imported lazily: tests/conftest.py reads the flag before jax starts.
"""

import contextlib
import importlib
import importlib.metadata
import inspect
import os
import re
import sys

# The jax versions the library is tested with (setup.py reads this line as text).
JAX_REQUIREMENT = ">=0.10.2,<0.13"

SPLASH_MODULE = "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel"
CUDNN_MODULE = "jax._src.cudnn.fused_attention_stablehlo"
CUDNN_CHECKS = ("check_compute_capability", "is_cuda_compute_capability_equal")

# The splash pieces, with the positional count and keywords the splash backend passes.
_COMMON_BWD = ("is_mqa", "mask_value", "attn_logits_soft_cap", "q_layout", "k_layout", "v_layout",
               "mask_function", "interpret")
SPLASH_CALLS = {
    "_splash_attention_forward": (6, ("mask_value", "is_mqa", "block_sizes",
                                      "residual_checkpoint_name", "save_residuals",
                                      "mask_function", "interpret")),
    "_splash_attention_bwd_dkv": (8, ("bq", "bkv", "bkv_compute", "mask_info",
                                      "use_fused_bwd_kernel") + _COMMON_BWD),
    "_splash_attention_bwd_dq": (8, ("bq", "bkv", "mask_info") + _COMMON_BWD),
}


def _version(distribution: str) -> str | None:
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def _release(text: str | None) -> tuple[int, ...]:
  """(0, 11, 2) of '0.11.2' (or '0.11.2.dev...'); () when unknown."""
  found = re.match(r"(\d+(?:\.\d+)*)", text or "")
  return tuple(int(p) for p in found.group(1).split(".")) if found else ()


def supported(version: str) -> bool:
  """Whether jax `version` is inside JAX_REQUIREMENT."""
  release = _release(version)
  for op, bound in re.findall(r"(>=|<=|==|<|>)\s*([\d.]+)", JAX_REQUIREMENT):
    b = _release(bound)
    ok = {">=": release >= b, "<=": release <= b, "==": release == b, "<": release < b,
          ">": release > b}[op]
    if not ok:
      return False
  return bool(release)


def jaxlib_release() -> tuple[int, ...]:
  """The installed jaxlib's (major, minor, patch), () if unknown (read without importing jax)."""
  return _release(_version("jaxlib"))


# What XLA does differently by version (the tests' compile mode, the partitioner's warnings).

def classic_cpu_emitters_flag() -> str:
  """'--xla_cpu_use_fusion_emitters=false' where the installed jaxlib knows it (< 0.11), else ''."""
  jaxlib = jaxlib_release()
  return "--xla_cpu_use_fusion_emitters=false" if jaxlib and jaxlib < (0, 11) else ""


def warns_of_full_rematerialization() -> bool:
  """Whether XLA logs "Involuntary full rematerialization" when it replicates an array to
  reshard it: jaxlib < 0.11. From 0.11 the partitioner (Shardy) inserts the same collectives
  without the warning."""
  jaxlib = jaxlib_release()
  return bool(jaxlib) and jaxlib < (0, 11)


# Splash.

def _splash_problems() -> dict[str, str]:
  """{private name: why the splash backend cannot call it} (empty when all are usable)."""
  try:
    module = importlib.import_module(SPLASH_MODULE)
  except ImportError as error:
    return {name: f"{SPLASH_MODULE} does not import ({error})" for name in SPLASH_CALLS}
  problems = {}
  for name, (positional, keywords) in SPLASH_CALLS.items():
    fn = getattr(module, name, None)
    if fn is None:
      problems[name] = f"{SPLASH_MODULE}.{name} is absent"
      continue
    try:
      inspect.signature(fn).bind(*([None] * positional), **dict.fromkeys(keywords))
    except (TypeError, ValueError) as error:
      problems[name] = f"{SPLASH_MODULE}.{name} takes other arguments now ({error})"
  return problems


_splash_checked: dict | None = None


def splash_missing() -> str | None:
  """Why the splash kernels cannot be called on this jax (one line), or None."""
  global _splash_checked
  if _splash_checked is None:
    _splash_checked = _splash_problems()
  if not _splash_checked:
    return None
  return f"jax {_version('jax')}: " + "; ".join(_splash_checked.values())


def _splash(name: str):
  reason = splash_missing()
  if reason is not None:
    raise NotImplementedError(reason)
  return getattr(importlib.import_module(SPLASH_MODULE), name)


def splash_forward(*args, **kwargs):
  """`splash_attention_kernel._splash_attention_forward(*args, **kwargs)`."""
  return _splash("_splash_attention_forward")(*args, **kwargs)


def splash_bwd_dkv(*args, **kwargs):
  """`splash_attention_kernel._splash_attention_bwd_dkv(*args, **kwargs)`."""
  return _splash("_splash_attention_bwd_dkv")(*args, **kwargs)


def splash_bwd_dq(*args, **kwargs):
  """`splash_attention_kernel._splash_attention_bwd_dq(*args, **kwargs)`."""
  return _splash("_splash_attention_bwd_dq")(*args, **kwargs)


# cuDNN's capability checks.

def _capability(text) -> tuple[int, int] | None:
  """(9, 0) of '9.0' or (9, 0); None if neither."""
  if isinstance(text, (tuple, list)) and len(text) == 2:
    return int(text[0]), int(text[1])
  found = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", str(text))
  return (int(found.group(1)), int(found.group(2))) if found else None


def _cudnn_module():
  """jax's cuDNN attention module if it has both capability checks, else None."""
  try:
    module = importlib.import_module(CUDNN_MODULE)
  except ImportError:
    return None
  return module if all(callable(getattr(module, name, None)) for name in CUDNN_CHECKS) else None


@contextlib.contextmanager
def cudnn_capability_answers(capability: tuple[int, int] | None):
  """Inside, jax's two cuDNN capability checks answer for `capability` (nothing when None or
  when this jax has no such checks); restored after. Process-wide while it lasts."""
  module = None if capability is None else _cudnn_module()
  if module is None:
    yield
    return
  saved = tuple(getattr(module, name) for name in CUDNN_CHECKS)

  def answer(original, compare):
    def check(wanted):
      parsed = _capability(wanted)
      return original(wanted) if parsed is None else compare(capability, parsed)
    return check

  module.check_compute_capability = answer(saved[0], lambda have, want: have >= want)
  module.is_cuda_compute_capability_equal = answer(saved[1], lambda have, want: have == want)
  try:
    yield
  finally:
    module.check_compute_capability, module.is_cuda_compute_capability_equal = saved


# The concrete mesh.

def _private_concrete_mesh():
  try:
    from jax._src import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return getattr(mesh_lib, "get_concrete_mesh", None)


def concrete_mesh():
  """The concrete `jax.sharding.Mesh` set by `jax.set_mesh` (while tracing too), or None when
  none is set (or, without jax's private getter, while tracing)."""
  import jax  # pylint: disable=g-import-not-at-top
  getter = _private_concrete_mesh()
  if getter is not None:
    mesh = getter()
  else:
    try:
      mesh = jax.sharding.get_mesh()
    except ValueError:  # inside jit: jax's public getter refuses
      return None
  devices = getattr(mesh, "devices", None)
  if getattr(mesh, "empty", False) or devices is None or not devices.ndim or not devices.size:
    return None
  return mesh


# The coordination service's client (a multi-process job's liveness and barriers).

def distributed_client():
  """The client of `jax.distributed`'s coordination service, or None (one process, or a jax
  without it where this module looks)."""
  try:
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return getattr(getattr(distributed, "global_state", None), "client", None)


# libtpu.

def tpu_library_path() -> str | None:
  """The libtpu shared library jax would load, or None without libtpu."""
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    getter = getattr(xla_bridge, "get_tpu_library_path", None)
  except ImportError:
    getter = None
  if getter is not None:
    return getter()
  path = os.environ.get("TPU_LIBRARY_PATH")
  if path and os.path.isfile(path):
    return path
  try:
    libtpu = importlib.import_module("libtpu")
  except ImportError:
    return None
  return libtpu.get_library_path() if hasattr(libtpu, "get_library_path") else None


# The report.

PLUGINS = ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt", "libtpu")


def missing() -> list[str]:
  """The private jax features this jax lacks, each as '<feature>: <why> (<fallback>)'."""
  out = []
  reason = splash_missing()
  if reason is not None:
    out.append(f"splash kernels: {reason} (TPU attention runs on xla)")
  if _cudnn_module() is None:
    out.append(f"cuDNN capability checks: {CUDNN_MODULE} lacks {' / '.join(CUDNN_CHECKS)} "
               "(compiling cuDNN for a GPU target from a host without one may refuse)")
  if _private_concrete_mesh() is None:
    out.append("jax._src.mesh.get_concrete_mesh is absent (a target's platform is not seen "
               "while tracing: the host's is used)")
  return out


def report() -> dict:
  """Python, jax, jaxlib and accelerator plugin versions, whether jax is in JAX_REQUIREMENT, and
  `missing()`."""
  jax_version = _version("jax")
  return {"python": sys.version.split()[0], "jax": jax_version, "jaxlib": _version("jaxlib"),
          "plugins": {name: _version(name) for name in PLUGINS if _version(name)},
          "numpy": _version("numpy"), "flax": _version("flax"),
          "jax_supported": bool(jax_version) and supported(jax_version),
          "jax_requirement": JAX_REQUIREMENT, "missing": missing()}


def report_line(info: dict | None = None) -> str:
  """`report()` in one line."""
  info = info or report()
  plugins = ", ".join(f"{k} {v}" for k, v in info["plugins"].items()) or "no accelerator plugin"
  line = (f"jax {info['jax']} (jaxlib {info['jaxlib']}; {plugins}), Python {info['python']}, "
          f"numpy {info['numpy']}, flax {info['flax']}")
  if not info["jax_supported"]:
    line += f"; jax outside the tested {info['jax_requirement']}"
  return line + "; missing: " + ("; ".join(info["missing"]) if info["missing"] else "none")
