"""Exporting a trained workdir: its weights in the export format (`export_format`: the format's
writer and reader, side by side) in a folder of their own (`python -m efficient_lm.export` is the
command; `efficient_lm.load` reads the folder).

`export(workdir, out)` writes into `out`: `model.safetensors` (or, past `max_shard_bytes`, shards and
their index), `config.json` (the run's config.json and a `format` block), the workdir's tokenizer
file as it is (tokenizer.model or tokenizer.json), and a `README.md` model card. The checkpoint
(latest, or `step`) is restored onto one CPU device whatever mesh or host count wrote it
(`inference.restore`); shapes come from the config.

An export never replaces what it did not write. `out` must be new, empty, or (with
`overwrite`) hold exactly a previous export: nothing but the names above and a config.json whose
`format` block names `efficient_lm.safetensors` (`is_previous_export`). A training workdir (the
one exported or any other), a folder inside one, and a folder holding anything else are refused
with or without `overwrite`. Everything is written into a temporary folder beside `out`
(`.<name>.<host>.<pid>.<random>.tmp`) and renamed into place; a previous export is renamed aside
(`... .old`) for that moment and removed once the new one is in place, so a failed or stopped
export leaves the previous one whole and nothing half-written. What an export stopped at once
(SIGKILL) left beside `out` is set right by the next export of it (`_clean_stale`). Imports no
jax, numpy or Orbax at module level: the command's refusals answer before they load.
"""
import json
import logging
import os
import re
import shutil
import socket

from efficient_lm.config.run import RunConfig
from efficient_lm.inference import export_format
from efficient_lm.inference.export_format import FORMAT, INDEX, WEIGHTS, ExportError
from efficient_lm.runtime import figures
from efficient_lm.runtime import signals
from efficient_lm.runtime.files import unique_suffix
from efficient_lm.state import workdir as workdir_lib

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
README = "README.md"
# What a folder an export wrote holds: nothing else (`is_previous_export`).
EXPORT_NAMES = (WEIGHTS, INDEX, workdir_lib.CONFIG, README, *workdir_lib.TOKENIZER_FILES)
# A training workdir's entries beside its config.json (`workdir_at`); a tokenizer file is not one:
# weights written elsewhere come with config.json and the tokenizer too.
_RUN_ENTRIES = (workdir_lib.DATA, workdir_lib.CHECKPOINTS, "metrics.jsonl", "tensorboard")

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Folders: what an export is, and where one may go (it never replaces what it did not write).


def is_export_name(name: str) -> bool:
  return name in EXPORT_NAMES or export_format.SHARD.fullmatch(name) is not None


def is_previous_export(path: str) -> bool:
  """Whether the folder `path` holds exactly an export's files: nothing but `EXPORT_NAMES` and
  shards, and a config.json whose `format` block names `FORMAT`. Only such a folder is replaced."""
  return (os.path.isdir(path) and all(is_export_name(n) for n in os.listdir(path))
          and export_format.format_block(path) is not None)


def _is_workdir(folder: str) -> bool:
  """A training workdir: config.json (not an export's) and a run's own entries beside it."""
  return (os.path.isfile(os.path.join(folder, workdir_lib.CONFIG))
          and any(os.path.exists(os.path.join(folder, n)) for n in _RUN_ENTRIES)
          and export_format.format_block(folder) is None)


def workdir_at(path: str) -> str | None:
  """The training workdir `path` is, or lies inside (the nearest), or None."""
  for start in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
    folder = start
    while True:
      if os.path.isdir(folder) and _is_workdir(folder):
        return folder
      parent = os.path.dirname(folder)
      if parent == folder:
        break
      folder = parent
  return None


def check_out(out: str, overwrite: bool) -> str:
  """The real path of --out (a link to a folder: that folder), or an ExportError when it cannot
  take the export: a file, a training workdir or a folder inside one, a folder holding anything
  but a previous export (with or without `overwrite`), a previous export without `overwrite`.
  Stale temporary folders of a stopped export are cleaned first (`_clean_stale`)."""
  shown = out
  out = os.path.realpath(os.path.abspath(os.path.expanduser(out)))
  _clean_stale(out)
  if os.path.exists(out) and not os.path.isdir(out):
    raise ExportError(f"--out={shown} is a file; give a folder path (it is created)")
  workdir = workdir_at(out)
  if workdir is not None:
    base = os.path.basename(workdir)
    instead = os.path.join(os.path.dirname(workdir), f"{base}_export")
    where = ("is a training workdir" if workdir == out else
             f"is inside the training workdir {workdir}")
    raise ExportError(f"--out={shown} {where}: an export never writes into a workdir (its "
                      "checkpoints, metrics.jsonl and data.json are the run's), with or without "
                      f"--overwrite; give a folder outside it, e.g. --out={instead}")
  entries = sorted(os.listdir(out)) if os.path.isdir(out) else []
  if not entries:
    return out
  if not is_previous_export(out):
    others = [n for n in entries if not is_export_name(n)]
    held = (f"holds {', '.join(others[:3])}{', ...' if len(others) > 3 else ''} ("
            f"{len(others)} of its {len(entries)} entries are not an export's)" if others else
            f"holds a {workdir_lib.CONFIG} that no export wrote (no format block naming {FORMAT})")
    raise ExportError(f"--out={shown} {held}: --overwrite replaces only a folder that holds "
                      "exactly a previous export, and this one is left as it is; give a new or "
                      "empty folder")
  if not overwrite:
    raise ExportError(f"--out={shown} holds an export already; give a new folder, or add "
                      "--overwrite to replace it")
  return out


def check_workdir(workdir: str) -> None:
  """An ExportError for an export given as --workdir, a WorkdirError for any other folder that is
  not a trained workdir."""
  path = os.path.abspath(os.path.expanduser(workdir))
  wd = workdir_lib.Workdir(path)
  if export_format.is_export(path) and not wd.has_checkpoints():
    what = "an export" if export_format.format_block(path) is not None else "a folder of weights"
    raise ExportError(f"--workdir={workdir} is {what} (it holds {WEIGHTS} or {INDEX}), not a "
                      "training workdir: there is nothing to export, efficient_lm.load("
                      f"{workdir!r}) reads it as it is; to export another step or dtype, give "
                      "--workdir the training workdir it came from")
  wd.require_trained()


# Temporary folders beside --out: `.<name>.<host>.<pid>.<random>.tmp` (the export being written)
# and `.<name>.<host>.<pid>.<random>.old` (the export it replaces, for the moment of the swap).


def _aside(out: str, kind: str) -> str:
  return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.{unique_suffix()}.{kind}")


def _alive(host: str, pid: int) -> bool:
  """Whether the process `pid` of `host` may still run (another host's: it may)."""
  if host != socket.gethostname() or pid == os.getpid():
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:  # (another user's process)
    return True
  return True


def _clean_stale(out: str) -> None:
  """What an export of `out` stopped at once (SIGKILL, a second signal, a power cut) left beside
  it, set right: a previous export renamed aside for the swap goes back to `out` when `out` is
  missing (else it is removed: it was replaced); a half-written new export is removed. Only
  folders of this naming, of a process of this host that no longer runs, and holding nothing but
  an export's files; anything else is left alone."""
  parent, base = os.path.split(out)
  pattern = re.compile(rf"\.{re.escape(base)}\.(.+)\.(\d+)\.[0-9a-f]{{8}}\.(old|tmp)")
  try:
    names = sorted(os.listdir(parent))
  except OSError:
    return
  stale = {"old": [], "tmp": []}
  for name in names:
    match = pattern.fullmatch(name)
    path = os.path.join(parent, name)
    if (match and not _alive(match[1], int(match[2])) and os.path.isdir(path)
        and all(is_export_name(n) for n in os.listdir(path))):
      stale[match[3]].append(path)
  for path in stale["old"]:
    if not os.path.exists(out) and export_format.format_block(path) is not None:
      os.rename(path, out)
      log.warning("put back %s: the export a stopped export was replacing, renamed aside as %s",
                  out, os.path.basename(path))
    else:
      shutil.rmtree(path, ignore_errors=True)
  for path in stale["tmp"]:
    shutil.rmtree(path, ignore_errors=True)


def _put_in_place(tmp: str, out: str, overwrite: bool) -> None:
  """Renames the finished folder `tmp` to `out` (an empty `out` removed first; a previous export,
  with `overwrite`, renamed aside and removed once the new one is in place). A first stop signal
  waits for the two renames (`signals.deferred`); an error between them puts the old one back."""
  check_out(out, overwrite)  # again: something may have appeared since the first check
  with signals.deferred("putting the export in place"):
    old = None
    if os.path.isdir(out):
      if os.listdir(out):
        old = _aside(out, "old")
        os.rename(out, old)
      else:
        os.rmdir(out)
    try:
      os.rename(tmp, out)
    except BaseException:
      if old is not None:
        os.rename(old, out)
      raise
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
    signals.check()  # a stop asked for meanwhile: the export is whole, the command stops now


# ----------------------------------------------------------------------------------------------
# Writing.


def last_eval(workdir: str, step: int) -> dict | None:
  """The last evaluation record of metrics.jsonl at or before `step` (None if there is none)."""
  path = os.path.join(workdir, "metrics.jsonl")
  found = None
  try:
    with open(path, encoding="utf-8") as f:
      for line in f:
        try:
          record = json.loads(line)
        except ValueError:
          continue  # a line torn by a kill
        if record.get("eval_loss") is not None and record.get("step", 0) <= step:
          found = record
  except OSError:
    return None
  return found


def model_card(config: RunConfig, *, step: int, num_params: int, dtype: str, files: list[str],
               tokenizer_files: list[str], evaluation: dict | None, command: str,
               shapes: dict[str, tuple]) -> str:
  """The export's README.md; `shapes`: {tensor name: shape}."""
  m, d = config.model, config.data
  stacked = sorted(k for k, v in shapes.items() if k.startswith("blocks.")
                   and not k.split(".")[1].isdigit() and v and v[0] <= m.num_layers)
  example = (f" (here `{stacked[0]}` is `{list(shapes[stacked[0]])}`)" if stacked else "")
  kv_heads = m.kv_heads  # (`model.num_kv_heads` resolved: 0 is num_heads)
  heads = f"{m.num_heads} heads" + (f" ({kv_heads} key/value heads)" if kv_heads != m.num_heads
                                    else "")
  shape = (f"d_model {m.d_model}, {m.num_layers} layers, {heads}, context (seq_len) "
           f"{m.seq_len}, vocabulary {m.vocab_size}, {m.position} positions")
  if evaluation is None:
    scored = "no evaluation in the workdir's metrics.jsonl"
  else:
    bpb, why = evaluation.get("eval_bits_per_byte"), evaluation.get("eval_bits_per_byte_reason")
    scored = (f"{config.train.eval_split} loss {evaluation['eval_loss']:.4f} nats/token"
              + (f", {bpb:.4f} bits per byte" if bpb is not None and not figures.not_finite(bpb)
                 else f", no bits per byte ({why})" if why else "")
              + f" at step {evaluation['step']} (metrics.jsonl)")
  weights = ", ".join(f"`{f}`" for f in files)
  return f"""# {m.name} (efficient_lm)

- Model: `{m.name}`: {shape}.
- Corpus: `{d.dataset}`.
- Training: step {step} (train.num_steps {config.train.num_steps}).
- Evaluation: {scored}.
- Parameters: {num_params:,}, stored as {dtype}.
- Files: {weights}, `config.json` (the run's config and a `format` block),
  {', '.join(f'`{f}`' for f in tokenizer_files)} (the tokenizer, as the workdir held it).

Tensors are named by module path (the dot-joined nnx state path, e.g. `embed.embedding`). Layers
that run under `nnx.scan` are stacked: each of their parameters is one tensor for all of them,
the layer axis first{example}; layers built one by one carry their index (`blocks.0.`, ...).

```python
import efficient_lm
model = efficient_lm.load("path/to/this/folder")
model.generate(["ROMEO:"], max_new_tokens=50)
```

Made with `{command}`.
"""


def check_args(*, dtype: str | None, max_shard_bytes: int, step: int | None) -> None:
  if dtype is not None and dtype not in DTYPES:
    raise ExportError(f"--dtype={dtype} is not an export dtype; use one of {', '.join(DTYPES)} "
                      "(or leave it out: the dtype trained)")
  if not max_shard_bytes >= 1:
    raise ExportError(f"--max_shard_bytes={max_shard_bytes} must be at least 1 (bytes per "
                      "safetensors file; default 5 GB)")
  if step is not None and step < 0:
    raise ExportError(f"--step={step} must be a checkpoint's step (>= 0), or left out for the "
                      "latest")


def export(workdir: str, out: str, *, step: int | None = None, dtype: str | None = None,
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
           command: str | None = None) -> dict:
  """Exports checkpoint `step` (default the latest) of `workdir` into the folder `out` (see the
  module docstring). Returns what was written: out, step, files, num_params, total_size, dtype."""
  check_args(dtype=dtype, max_shard_bytes=max_shard_bytes, step=step)
  workdir = os.path.abspath(os.path.expanduser(workdir))
  out = check_out(out, overwrite)
  check_workdir(workdir)
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  # Imported here: jax and Orbax load only after the export command's refusals.
  from efficient_lm.inference import restore as restore_lib  # pylint: disable=import-outside-toplevel
  asked = step
  try:
    restored = restore_lib.restore(workdir, step=step, device=jax.devices("cpu")[0], exports=False)
  except restore_lib.LoadError as e:  # (a --step the checkpoints lack): the command's refusal
    raise ExportError(str(e)) from None
  step, config = restored.step, restored.config
  tensors = {}
  for name, (_, value) in export_format.flat_names(nnx.state(restored.model)).items():
    array = np.asarray(jax.device_get(value))
    if dtype is not None and jax.numpy.issubdtype(array.dtype, jax.numpy.floating):
      array = array.astype(jax.numpy.dtype(dtype))
    tensors[name] = array
  dtypes = sorted({v.dtype.name for v in tensors.values()})
  with open(os.path.join(workdir, workdir_lib.CONFIG), encoding="utf-8") as f:
    saved = json.load(f)
  command = command or (f"python -m efficient_lm.export --workdir={workdir} --out={out}"
                        + (f" --step={asked}" if asked is not None else "")
                        + (f" --dtype={dtype}" if dtype else ""))
  os.makedirs(os.path.dirname(out), exist_ok=True)
  tmp = _aside(out, "tmp")  # beside --out: the rename into place stays on one filesystem
  os.mkdir(tmp)
  try:
    files = export_format.write_weights(tensors, tmp, max_shard_bytes)
    tokenizer = workdir_lib.Workdir(workdir).tokenizer_file()  # tokenizer.model or .json
    copied = [os.path.basename(tokenizer)]
    shutil.copyfile(tokenizer, os.path.join(tmp, copied[0]))
    export_format.write_config(tmp, saved, step=step, dtype="/".join(dtypes), files=files)
    num_params = sum(int(v.size) for v in tensors.values())
    card = model_card(config, step=step, num_params=num_params, dtype="/".join(dtypes),
                      files=files, tokenizer_files=copied, evaluation=last_eval(workdir, step),
                      command=command, shapes={k: v.shape for k, v in tensors.items()})
    with open(os.path.join(tmp, README), "w", encoding="utf-8") as f:
      f.write(card)
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(tmp):  # safetensors' private modes: the usual ones
      os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
    os.chmod(tmp, 0o777 & ~umask)
    _put_in_place(tmp, out, overwrite)
  finally:
    if os.path.exists(tmp):
      shutil.rmtree(tmp, ignore_errors=True)
  return {"out": out, "step": step, "files": files, "num_params": num_params,
          "total_size": sum(v.nbytes for v in tensors.values()), "dtype": "/".join(dtypes),
          "tokenizer": copied}
