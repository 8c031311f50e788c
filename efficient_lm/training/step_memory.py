"""The compiled train step and what it needs per device: will this run fit?

    compiled = step_memory.compile_train_step(run, built)
    report = step_memory.report(compiled, run, built)      # bytes per device
    step_memory.check_fits(report)                          # StepTooLargeError if it cannot

`compile_train_step` lowers and compiles exactly the step `training/loop.py` runs (the
same shardings, layout, remat, loss chunking and gradient accumulation) from
abstract arrays: no data and no parameters are needed, so
`python -m efficient_lm.main --compile_only` answers "will this fit?" in the
time of one compilation (for this host's devices, or a `--target`'s), and the
training loop checks it before its first step.

The figure per device is the one each platform means. TPU: the compiled
program's peak (`peak_memory_in_bytes`) plus its code; `temp_size_in_bytes`
there is about 1.5x the buffer assignment and would refuse steps that fit.
CPU and GPU: arguments + outputs - donated + temporaries + code. A GPU target's
figure leaves out cuDNN's workspace (its graph is not built without a GPU).
"""

import collections
import os
import re

import jax
import jax.numpy as jnp

from efficient_lm import models
from efficient_lm.config.run import RunConfig
from efficient_lm.ops.core import backends
from efficient_lm.parallel import sharding
from efficient_lm.parallel import targets
from efficient_lm.state import train_state
from efficient_lm.training import step as train_step_lib


class StepTooLargeError(MemoryError):
  """The compiled train step needs more memory than a device has."""


def abstract_batch(run: RunConfig, built: train_state.Built) -> dict:
  """The shapes of a batch placed on `built`'s mesh (`train_state.build`): with RoPE positions
  for a permuted layout (`built.layout`), with document ids where it carries them."""
  B, T = run.data.batch_size, run.data.seq_len
  batch_sharding = sharding.batch_sharding(built.mesh)
  shape = lambda dtype: jax.ShapeDtypeStruct((B, T), dtype, sharding=batch_sharding)
  batch = {"inputs": shape(jnp.int32), "targets": shape(jnp.int32), "weights": shape(jnp.float32)}
  if built.layout != "natural":
    batch["positions"] = shape(jnp.int32)
  if built.document_ids:
    batch["segment_ids"] = shape(jnp.int32)
  return batch


def make_train_step(run: RunConfig, built: train_state.Built):
  """The jitted train step of `run` for `built` (`train_state.build`)."""
  return train_step_lib.make_train_step(
      built.graphdef, built.tx, built.schedule, run.train.seed,
      state_shardings=built.shardings, batch_sharding=sharding.batch_sharding(built.mesh),
      grad_accum_steps=run.train.grad_accum_steps,
      loss_chunk=run.train.loss_chunk,
      activation_rules=run.mesh.activation_axes)


def compile_train_step(run: RunConfig, built: train_state.Built):
  """The train step, lowered and compiled for abstract arguments (jax.stages.Compiled).
  StepTooLargeError when the compiler itself finds it cannot fit (a TPU's out of HBM)."""
  abstract_state = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), built.state)
  backends.FALLBACKS.clear()  # what this step's trace records (the compile report reads them)
  backends.KERNEL_CALLS.clear()
  lowered = make_train_step(run, built).lower(abstract_state, abstract_batch(run, built))
  try:
    return lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    message = str(e)
    if "RESOURCE_EXHAUSTED" not in message:
      raise
    first = next((line for line in message.splitlines() if "RESOURCE_EXHAUSTED" in line), message)
    hint = fix_hint({"attention_backend": models.attention_backend_name(
        run.model, targets.platform_of(list(built.mesh.devices.flat)))})
    raise StepTooLargeError(f"the train step does not fit on {built.mesh.devices.flat[0].device_kind}"
                            f" ({first.strip()[:300]}); lower it with {hint}") from None


def available_bytes(device: jax.Device | None = None) -> tuple[int | None, str]:
  """(bytes one device may use, what they are): an accelerator's memory limit, or on CPU the host
  RAM available now shared by this process's devices."""
  device = device or jax.local_devices()[0]
  if device.platform != "cpu":
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit") or stats.get("bytes_reservable_limit")
    return (int(limit) if limit else None), f"{device.platform} memory"
  available = None
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          available = int(line.split()[1]) * 1024
  except OSError:
    pass
  if available is None and hasattr(os, "sysconf"):
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  devices = len([d for d in jax.local_devices() if d.platform == "cpu"]) or 1
  return (available // devices if available else None), (
      "host RAM available" + (f" / {devices} CPU devices" if devices > 1 else ""))


COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?\S+ = .*?[\s)}\]](" + "|".join(COLLECTIVES)
                         + r")(?:-start)?\(", re.MULTILINE)


def collective_counts(compiled) -> dict[str, int]:
  """How many of each collective the compiled module holds (an op inside a loop body, such as a
  scanned layer's, counts once however often the loop runs)."""
  counts = collections.Counter(m.group(1) for m in _COLLECTIVE.finditer(compiled.as_text()))
  return {name: counts.get(name, 0) for name in COLLECTIVES}


# A kernel's custom call: the TPU's Mosaic kernels (splash), the GPU's Triton kernels and cuDNN.
_CUSTOM_CALL = re.compile(r"^\s*(?:ROOT )?%?([\w.$-]+) = .*?custom-call\(.*?"
                          r"custom_call_target=\"([^\"]+)\"", re.MULTILINE)
KERNEL_KINDS = {"tpu_custom_call": "tpu", "triton": "triton", "cudnn": "cudnn"}  # target word -> kind


def _kernels(hlo_text: str):
  """(kind, name) of every attention-kernel custom call of a compiled module's text."""
  for name, target in _CUSTOM_CALL.findall(hlo_text):
    word = next((w for w in KERNEL_KINDS if w in target), None)
    if word is not None:
      base = re.sub(r"\.\d+$", "", name)
      base = target if base.startswith("custom-call") else base
      kind = KERNEL_KINDS[word]
      yield kind, base if kind == "tpu" or kind in base else f"{kind} {base}"


def kernel_counts(compiled) -> dict[str, int]:
  """{kernel name: calls} of the attention kernels in the compiled module (the instruction's name
  without its `.N` suffix, else the custom call's target; GPU kernels prefixed 'triton' or
  'cudnn'; a call inside a loop body counts once)."""
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  return dict(sorted(collections.Counter(name for _, name in _kernels(text)).items()))


def kernel_kinds(hlo_text: str) -> dict[str, int]:
  """{'cudnn' | 'triton' | 'tpu': calls} of the attention kernels in a compiled module's text."""
  counts = dict.fromkeys(("cudnn", "triton", "tpu"), 0)
  for kind, _ in _kernels(hlo_text):
    counts[kind] += 1
  return counts


def attention_report() -> dict:
  """What the last traced step's attention ran on: its kernel calls and tiles as traced
  (`attention_tiles`), and each call that fell back to the XLA core with the reason."""
  return {"attention_tiles": {f"{backend}: {what}": n
                              for (backend, what), n in sorted(backends.KERNEL_CALLS.items())},
          "attention_fallbacks": [{"backend": backend, "reason": reason, "calls": n}
                                  for (backend, reason), n in sorted(backends.FALLBACKS.items())]}


def report(compiled, run: RunConfig, built: train_state.Built, target=None) -> dict:
  """Per-device bytes of the compiled step (XLA's memory analysis) and of the train state, the
  platform's figure (`per_device_total_bytes`) against what a device has: this host's, or the
  `target`'s (`targets.Target`)."""
  memory = compiled.memory_analysis()
  get = lambda name: int(getattr(memory, name, 0) or 0)
  platform = target.platform if target is not None else targets.platform_of(
      list(built.mesh.devices.flat))
  params, params_replicated = sharding.per_device_bytes(built.state.params)
  opt, opt_replicated = sharding.per_device_bytes(built.state.opt_state)
  out = {
      "per_device_argument_bytes": get("argument_size_in_bytes"),
      "per_device_output_bytes": get("output_size_in_bytes"),
      "per_device_alias_bytes": get("alias_size_in_bytes"),
      "per_device_temp_bytes": get("temp_size_in_bytes"),
      "per_device_code_bytes": get("generated_code_size_in_bytes"),
      "per_device_param_bytes": params, "param_replicated_fraction": params_replicated,
      "per_device_optimizer_bytes": opt, "optimizer_replicated_fraction": opt_replicated,
      "seq_len": int(run.data.seq_len), "batch_size": int(run.data.batch_size),
      "num_devices": int(built.mesh.size), "mesh": dict(built.mesh.shape),
      "model": run.model.name,
      "attention_impl": run.model.attention_impl,
      "attention_backend": models.attention_backend_name(run.model, platform),
      "platform": platform,
      "target": target.spec if target is not None else None,
      "num_slices": target.num_slices if target is not None else 1,
      "per_device_peak_bytes": get("peak_memory_in_bytes") or None,
  }
  if platform == "tpu":  # the program's peak: what it allocates (temporaries are overstated)
    out["per_device_total_bytes"] = get("peak_memory_in_bytes") + out["per_device_code_bytes"]
    out["memory_figure"] = "peak + code"
  else:  # donated arguments alias outputs: arguments + outputs - aliases + temporaries + code
    out["per_device_total_bytes"] = (
        out["per_device_argument_bytes"] + out["per_device_output_bytes"]
        - out["per_device_alias_bytes"] + out["per_device_temp_bytes"] + out["per_device_code_bytes"])
    out["memory_figure"] = "arguments + outputs - donated + temporaries + code"
  if target is not None:
    available, what = target.available_bytes, f"{target.device_kind} usable memory"
    out["device_memory_bytes"] = target.memory_bytes
  else:
    available, what = available_bytes()
    out["device_memory_bytes"] = available
  out["per_device_available_bytes"] = available
  out["available_is"] = what
  out["collectives"] = collective_counts(compiled)
  out["attention_kernels"] = kernel_counts(compiled)
  out.update(attention_report())
  out["fits"] = available is None or out["per_device_total_bytes"] <= available
  return out


def gib(n: int | None) -> str:
  return "unknown" if n is None else f"{n / 2**30:,.2f} GiB"


def describe(r: dict) -> str:
  where = f"{r['num_devices']} device(s)" + (f" of {r['target']}" if r.get("target") else "")
  peak = (f"peak {gib(r['per_device_peak_bytes'])}, " if r.get("platform") == "tpu" else "")
  return (f"train step of {r['model']} at seq_len {r['seq_len']:,}, batch {r['batch_size']} on "
          f"{where}: {gib(r['per_device_total_bytes'])} per device ({peak}"
          f"temporaries {gib(r['per_device_temp_bytes'])}, arguments "
          f"{gib(r['per_device_argument_bytes'])}, outputs {gib(r['per_device_output_bytes'])}, "
          f"{gib(r['per_device_alias_bytes'])} of them donated); {r['available_is']}: "
          f"{gib(r['per_device_available_bytes'])}" + attention_line(r))


def attention_line(r: dict) -> str:
  """"; attention: N kernel calls, M fallbacks (why)" of a report, or "" without its fields."""
  if "attention_kernels" not in r:
    return ""
  fallbacks = r["attention_fallbacks"]
  why = "; ".join(f"{f['calls']} on {f['backend']}: {f['reason']}" for f in fallbacks)
  kernels = ", ".join(f"{n} {name}" for name, n in r["attention_kernels"].items())
  return (f"; attention: {sum(r['attention_kernels'].values())} kernel calls"
          f"{f' ({kernels})' if kernels else ''}, {sum(f['calls'] for f in fallbacks)} fallbacks"
          f"{f' ({why})' if why else ''}")


def fix_hint(r: dict) -> str:
  """The settings that lower a step's memory, for the one-line refusals."""
  dense = ("model.attention_impl='xla' (O(T) memory instead of the [T, T] scores), "
           if r.get("attention_backend") == "reference" else "")
  return (f"{dense}model.remat='block', train.loss_chunk (e.g. 8192), a smaller data.batch_size "
          "(or train.grad_accum_steps), or more devices along mesh.context / mesh.fsdp")


def check_fits(r: dict) -> None:
  """StepTooLargeError (one line naming the fields that help) when the step cannot fit."""
  needed, available = r["per_device_total_bytes"], r["per_device_available_bytes"]
  if r["fits"]:
    return
  raise StepTooLargeError(
      f"the train step needs {gib(needed)} per device ({r['memory_figure']}; temporaries "
      f"{gib(r['per_device_temp_bytes'])}) but {r['available_is']} is {gib(available)}; lower it "
      f"with {fix_hint(r)}")


__all__ = ["COLLECTIVES", "StepTooLargeError", "abstract_batch", "available_bytes", "check_fits",
           "collective_counts", "compile_train_step", "describe", "fix_hint", "report"]
