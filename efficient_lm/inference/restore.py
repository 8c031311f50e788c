"""One way to a trained model: `restore(path)` opens a training workdir (its latest checkpoint, or
`step`) or a folder in the export format, and returns what every user of a trained model needs.

    restored = restore("runs/pi_attention")                # onto one device
    restored = restore("runs/pi_attention", sharded=True)  # over this host's devices, as trained
    restored.model(ids_BT); restored.tokenizer.encode(text); restored.config.model.name

`efficient_lm.load`, the export command, sampling, evaluation, the lm-eval adapter and the
long-context tasks all come through here. The run's config is a `RunConfig` read back from its
config.json (`Workdir.saved_config`, or the export's: every section's declared checks run, the
fields added since at their defaults) and checked on the devices it is restored onto as the edge
checks a fresh run's model (`train_state.build` from shapes: `models.placement`'s rules); a
`model.attention_impl` whose kernels cannot run there (splash off a TPU) runs on 'auto' instead,
with the same parameters. A checkpoint is restored straight onto those devices whatever mesh or
host count saved it; an export's tensors are read by name against the model its config describes.
"""

import dataclasses
import os
from typing import Any

import jax
from flax import nnx

from efficient_lm import families
from efficient_lm.config import run as config_run
from efficient_lm.config.run import RunConfig
from efficient_lm.data.tokenizer import open_tokenizer
from efficient_lm.inference import export_format
from efficient_lm.inference.export_format import LoadError
from efficient_lm.ops.core import backends
from efficient_lm.parallel import sharding
from efficient_lm.state import checkpoint
from efficient_lm.state import train_state
from efficient_lm.state import workdir as workdir_lib


@dataclasses.dataclass(frozen=True)
class Restored:
  """A trained model, ready to run: `model` (the nnx module, its parameters on `mesh`), its
  `tokenizer` (a sentencepiece, Hugging Face or generated task's tokenizer: `data.tokenizer`), the
  run's `config`, the checkpoint's `step` (None for weights exported elsewhere without one), the
  folder (`path`) and what it is (`kind`: 'workdir' or 'export')."""
  model: nnx.Module
  tokenizer: Any
  config: RunConfig
  step: int | None
  path: str
  kind: str = "workdir"
  mesh: jax.sharding.Mesh | None = None

  @property
  def seq_len(self) -> int:
    """The context the model was trained on (`model.seq_len`)."""
    return self.config.model.seq_len

  @property
  def eos_id(self) -> int:
    """The end-of-document id that starts every document."""
    return int(self.tokenizer.eos_id)


def restore(path: str, *, step: int | None = None, device: jax.Device | None = None,
            sharded: bool = False, exports: bool = True) -> Restored:
  """The model, tokenizer and config of the training workdir `path` (its latest checkpoint, or
  `step`) or, with `exports`, of a folder in the export format (`export_format.is_export`).

  Onto `device` alone (default: the first of jax's default backend), or with `sharded` over this
  host's devices (`local_mesh`: the parameters sharded as the run's rules say). A LoadError names
  a folder that is neither, a `step` an export or the checkpoints do not hold, weights that do not
  fit its config; a workdir's own problems (no checkpoint yet) are its WorkdirError."""
  path = os.path.abspath(os.path.expanduser(path))
  if exports and not os.path.isdir(path):
    raise LoadError(f"{path} is not a folder; give a training workdir or a folder "
                    "`python -m efficient_lm.export` wrote")
  if exports and export_format.is_export(path):
    if step is not None:
      raise LoadError(f"step={step}: {path} is an export, which holds one step; leave step out, or "
                      "load the workdir it came from")
    raw, fmt = export_format.read_config(path)
    run, step, kind = config_run.build(raw, families.CLASSES, saved=True), fmt.get("step"), "export"
  elif not exports or os.path.isfile(os.path.join(path, workdir_lib.CONFIG)):
    wd = workdir_lib.Workdir(path)
    wd.require_trained()
    run, kind = wd.saved_config(), "workdir"
  else:
    raise LoadError(f"{path} holds neither {export_format.WEIGHTS} (an export) nor "
                    f"{workdir_lib.CONFIG} and checkpoints/ (a training workdir); give one of those "
                    "folders")
  if sharded:
    mesh = local_mesh(run)
  else:
    mesh = one_device_mesh(device if device is not None else jax.devices()[0])
  run = runnable(run, mesh.devices.flat[0].platform)
  built = train_state.build(run, mesh, abstract=True)
  if kind == "export":
    params = export_format.read_params(path, built.state.params)
  else:
    step, params = _checkpoint(wd, step, built)
  tokenizer = _tokenizer(path, run)
  return Restored(nnx.merge(built.graphdef, params), tokenizer, run, step, path, kind, mesh)


def _checkpoint(wd: workdir_lib.Workdir, step: int | None, built: train_state.Built):
  """(step, parameters) of the workdir's latest checkpoint, or of `step`, restored onto `built`'s
  shardings."""
  steps = checkpoint.committed_steps(wd.checkpoints)
  if step is not None and step not in steps:
    raise LoadError(f"--step={step} is not a committed checkpoint of {wd.checkpoints} (it has "
                    f"{', '.join(map(str, steps)) or 'none'}); give one of them, or leave --step "
                    "out for the latest")
  ckpt = checkpoint.Checkpointer(wd.checkpoints, max_to_keep=None)
  try:
    if step is None:
      restored = ckpt.restore_latest(built.state, lambda meta: None, set_aside=False)
      if restored is None:
        raise workdir_lib.WorkdirError(f"{wd.checkpoints} has no checkpoint yet: train first, or "
                                       "wait for the first save (train.checkpoint_every)")
      step, state, _ = restored
    else:
      state, _ = ckpt.restore(step, built.state)
  finally:
    ckpt.close()
  return int(step), state.params


def _tokenizer(path: str, run: RunConfig):
  """The tokenizer a workdir or an export folder holds (tokenizer.model or tokenizer.json), with
  the separator its run used."""
  if not any(os.path.isfile(os.path.join(path, name)) for name in workdir_lib.TOKENIZER_FILES):
    raise LoadError(f"{path} has no tokenizer file ({' or '.join(workdir_lib.TOKENIZER_FILES)}); "
                    "copy the tokenizer the model was trained with into it")
  return open_tokenizer(path, run.data.separator_token)


def runnable(run: RunConfig, platform: str) -> RunConfig:
  """`run` as `platform` ('cpu', 'gpu', 'tpu') can build it: a `model.attention_impl` whose
  kernels cannot run there (splash off TPU, gpu off GPU) is 'auto' instead; the parameters are
  the same."""
  model = run.model
  if backends.check(model.attention_impl, platform, model.kernel_interpret) is None:
    return run
  return dataclasses.replace(run, model=dataclasses.replace(model, attention_impl="auto",
                                                            kernel_interpret=False))


def one_device_mesh(device: jax.Device) -> jax.sharding.Mesh:
  """A mesh of `device` alone with the four axes (`sharding.single_device_mesh`, on any device)."""
  return jax.make_mesh((1, 1, 1, 1), sharding.AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * 4, devices=[device])


def local_mesh(run: RunConfig) -> jax.sharding.Mesh:
  """The mesh a trained model is sharded over on this host: every local device along `fsdp`
  (parameters sharded as in training, batch rows split), the run's `mesh.tensor`; the sequence
  whole (context 1)."""
  mesh = dataclasses.replace(run.mesh, data=1, fsdp=-1, context=1, dcn_data=1, dcn_fsdp=1)
  return sharding.make_mesh(mesh, jax.local_devices())


__all__ = ["LoadError", "Restored", "local_mesh", "one_device_mesh", "restore", "runnable"]
