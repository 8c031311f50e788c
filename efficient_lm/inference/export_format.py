"""The export format, written and read side by side: a trained model's weights as safetensors with
its config.json and tokenizer (`python -m efficient_lm.export` writes it, `inference.restore`
reads it, docs/using_a_model.md).

A folder in the format holds `model.safetensors` (or, past a size, `model-00001-of-0000K.safetensors`
... and `model.safetensors.index.json`, the usual `{"metadata": {"total_size": ...},
"weight_map": {name: file}}`), `config.json` (the run's config.json and a `format` block: what
wrote it, the step, the dtype) and the run's tokenizer file. Tensors are named by their module
path (the dot-joined nnx state path, e.g. `blocks.mixer.attn.qkv.kernel`); the layers, stacked by
`nnx.scan`, are one tensor each with the layer axis first. A file written elsewhere with the same
names and shapes reads the same way. Imports no jax, numpy or safetensors at module level: the
export command's refusals answer before they load.
"""

import contextlib
import json
import os
import re

from efficient_lm.state import workdir as workdir_lib

FORMAT = "efficient_lm.safetensors"  # config.json's format.name
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


class LoadError(ValueError):
  """A folder that cannot be loaded (neither a workdir nor an export, or weights that do not fit
  the model of its config.json); the message names the first problem and the fix."""


class ExportError(ValueError):
  """An export that cannot run as asked (no checkpoint, an occupied --out, bad flags)."""


# ----------------------------------------------------------------------------------------------
# Names: the dot-joined nnx state path of every parameter.


def flat_names(params) -> dict[str, tuple[tuple, object]]:
  """{name: (path in `nnx.to_pure_dict(params)`, leaf)} for an nnx State (arrays or shapes)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  out = {}

  def walk(tree, prefix):
    for key, value in tree.items():
      if isinstance(value, dict):
        walk(value, prefix + (key,))
        continue
      name = ".".join(str(k) for k in prefix + (key,))
      if name in out:
        raise ExportError(f"two parameters are both named {name!r}; rename one module")
      out[name] = (prefix + (key,), value)

  walk(nnx.to_pure_dict(params), ())
  return out


# ----------------------------------------------------------------------------------------------
# Writing.


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
  """Tensor names (in name order) cut into files of at most `max_shard_bytes` each (a larger
  tensor alone in its own)."""
  shards, used = [[]], 0
  for name in sorted(sizes):
    if shards[-1] and used + sizes[name] > max_shard_bytes:
      shards.append([])
      used = 0
    shards[-1].append(name)
    used += sizes[name]
  return shards


def shard_file(i: int, count: int) -> str:
  return WEIGHTS if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def write_weights(tensors: dict, folder: str, max_shard_bytes: int) -> list[str]:
  """`tensors` ({name: numpy array}) as safetensors files in `folder` (and the index when there is
  more than one); returns the files written."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  shards = plan_shards({k: v.nbytes for k, v in tensors.items()}, max_shard_bytes)
  files = [shard_file(i, len(shards)) for i in range(len(shards))]
  for names, file in zip(shards, files):
    save_file({k: tensors[k] for k in names}, os.path.join(folder, file),
              metadata={"format": "flax"})
  if len(shards) > 1:
    index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
             "weight_map": {k: f for names, f in zip(shards, files) for k in names}}
    with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as f:
      json.dump(index, f, indent=2, sort_keys=True)
    files.append(INDEX)
  return files


def write_config(folder: str, saved: dict, *, step: int, dtype: str, files: list[str]) -> None:
  """The run's config.json (`saved`, as the workdir holds it) into `folder`, with the `format`
  block: this format and its version, the step, the dtype and the weights' file."""
  saved = dict(saved, format={"name": FORMAT, "version": FORMAT_VERSION, "step": step,
                              "dtype": dtype, "weights": INDEX if len(files) > 1 else WEIGHTS})
  with open(os.path.join(folder, workdir_lib.CONFIG), "w", encoding="utf-8") as f:
    json.dump(saved, f, indent=2)


# ----------------------------------------------------------------------------------------------
# Reading.


def is_export(path: str) -> bool:
  """Whether `path` holds weights to load (`model.safetensors` or the index): an export, or weights
  written elsewhere (`efficient_lm.load` reads both)."""
  return any(os.path.isfile(os.path.join(path, name)) for name in (WEIGHTS, INDEX))


def format_block(path: str) -> dict | None:
  """The `format` block of the folder's config.json when it names this format (what an export
  writes), else None."""
  try:
    with open(os.path.join(path, workdir_lib.CONFIG), encoding="utf-8") as f:
      fmt = json.load(f).get("format")
  except (OSError, ValueError, AttributeError):
    return None
  return fmt if isinstance(fmt, dict) and fmt.get("name") == FORMAT else None


def read_config(path: str) -> tuple[dict, dict]:
  """(the run's config: its sections as config.json holds them, its format block: {} for a
  config.json written elsewhere) of an export folder."""
  file = os.path.join(path, workdir_lib.CONFIG)
  try:
    with open(file, encoding="utf-8") as f:
      raw = json.load(f)
  except (OSError, ValueError) as e:
    raise LoadError(f"{file} cannot be read as JSON ({e}); an export needs the run's config.json "
                    "(`python -m efficient_lm.export` writes it)") from e
  fmt = raw.pop("format", None) or {}
  if fmt.get("name") == FORMAT and fmt.get("version", 0) > FORMAT_VERSION:
    raise LoadError(f"{file} is export format version {fmt['version']}, newer than this library "
                    f"reads ({FORMAT_VERSION}); update efficient_lm")
  if "model" not in raw or "name" not in raw.get("model", {}):
    raise LoadError(f"{file} has no model section with a name; give the run's config.json (a "
                    "workdir's, or what `python -m efficient_lm.export` wrote)")
  return raw, fmt


def weight_files(path: str) -> dict[str, str]:
  """{tensor name: file} of an export folder, from its index (sharded) or its single file."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  index = os.path.join(path, INDEX)
  if os.path.isfile(index):
    try:
      with open(index, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise LoadError(f"{index} has no readable weight_map ({type(e).__name__}: {e}); rewrite it "
                      "as {\"metadata\": {...}, \"weight_map\": {name: file}}") from e
    files = sorted(set(weight_map.values()))
  else:
    weight_map, files = None, [WEIGHTS]
  where = {}
  for file in files:
    full = os.path.join(path, file)
    if not os.path.isfile(full):
      raise LoadError(f"{full} is missing ({INDEX} maps tensors to it); copy the whole export "
                      "folder")
    with safe_open(full, framework="numpy") as f:
      for name in f.keys():
        if name in where:
          raise LoadError(f"tensor {name!r} is in both {where[name]} and {file}; keep one")
        where[name] = file
  if weight_map is not None:
    for name, file in weight_map.items():
      if where.get(name) != file:
        raise LoadError(f"{INDEX} maps tensor {name!r} to {file}, which does not hold it; rewrite "
                        "the index from the files")
  return where


def check_tensors(path: str, where: dict[str, str], expected: dict) -> None:
  """A LoadError naming the first missing or unexpected tensor, or the first of another shape or
  kind of dtype (a floating tensor loads into a floating parameter of any width)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  config = os.path.join(path, workdir_lib.CONFIG)
  missing = sorted(set(expected) - set(where))
  if missing:
    name = missing[0]
    want = expected[name][1]
    raise LoadError(f"{path} has no tensor {name!r} ({tuple(want.shape)} {want.dtype}), which the "
                    f"model of {config} needs ({len(missing)} missing); name the tensors by module "
                    "path, as `python -m efficient_lm.export` writes them")
  unexpected = sorted(set(where) - set(expected))
  if unexpected:
    name = unexpected[0]
    raise LoadError(f"{os.path.join(path, where[name])} holds tensor {name!r}, which the model of "
                    f"{config} does not have ({len(unexpected)} unexpected; the model's names "
                    f"include {', '.join(sorted(expected)[:3])}); remove it or fix config.json")
  with contextlib.ExitStack() as stack:
    files = {file: stack.enter_context(safe_open(os.path.join(path, file), framework="numpy"))
             for file in sorted(set(where.values()))}
    shapes = {name: (tuple(files[where[name]].get_slice(name).get_shape()),
                     files[where[name]].get_slice(name).get_dtype()) for name in expected}
  for name in sorted(expected):
    want = expected[name][1]
    shape, dtype = shapes[name]
    kind = "float" if dtype.startswith(("F", "BF")) else dtype
    want_kind = "float" if jnp.issubdtype(want.dtype, jnp.floating) else None
    if shape != tuple(want.shape) or (kind == "float") != (want_kind == "float"):
      raise LoadError(f"tensor {name!r} in {os.path.join(path, where[name])} has shape {shape} "
                      f"{dtype}, the model of {config} expects {tuple(want.shape)} {want.dtype}; "
                      "export the weights of a run with this config.json")


def read_params(path: str, params):
  """The parameters of an export folder, read into `params` (an abstract train state's: their
  shapes, dtypes and shardings), each tensor placed where its sharding says; every tensor checked
  first (`check_tensors`)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  expected = flat_names(params)
  where = weight_files(path)
  check_tensors(path, where, expected)
  pure = nnx.to_pure_dict(params)
  with contextlib.ExitStack() as stack:
    files = {file: stack.enter_context(safe_open(os.path.join(path, file), framework="numpy"))
             for file in sorted(set(where.values()))}
    for name, (keys, want) in expected.items():
      node = pure
      for key in keys[:-1]:
        node = node[key]
      array = np.asarray(files[where[name]].get_tensor(name)).astype(want.dtype)
      node[keys[-1]] = jax.device_put(array, want.sharding)
  nnx.replace_by_pure_dict(params, pure)
  return params


__all__ = ["ExportError", "FORMAT", "FORMAT_VERSION", "INDEX", "LoadError", "WEIGHTS",
           "check_tensors", "flat_names", "format_block", "is_export", "plan_shards",
           "read_config", "read_params", "shard_file", "weight_files", "write_config",
           "write_weights"]
