"""`efficient_lm.load(path)`: a trained model, from a workdir or an export, to score and sample.

    import efficient_lm
    lm = efficient_lm.load("runs/pi_attention")      # a training workdir: its latest checkpoint
    lm = efficient_lm.load("exports/pi_attention")   # or what `python -m efficient_lm.export` wrote
    lm.logits(ids_BT)                  # int [B, T] -> float32 [B, T, V]
    lm.score(["To be, or not to be"])  # nats/token and bits per byte, per text and overall
    lm.generate(["ROMEO:\\n"], max_new_tokens=50)

A workdir's checkpoint is restored onto one device (the first of jax's default backend) whatever
mesh saved it; an export's safetensors are read by name against the model its config.json
describes, so a file written elsewhere with the same names and shapes loads the same way
(docs/using_a_model.md).
"""

import contextlib
import json
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from efficient_lm.config import base as config_base
from efficient_lm.data import corpus as corpus_lib
from efficient_lm.data import round_trip
from efficient_lm.data.tokenizer import open_tokenizer
from efficient_lm.evaluation import scoring
from efficient_lm.inference import export as export_lib
from efficient_lm.inference import generation
from efficient_lm.runtime import progress
from efficient_lm.state import checkpoint
from efficient_lm.state import train_state
from efficient_lm.state import workdir as workdir_lib
from efficient_lm.training import metrics as metrics_lib


class LoadError(ValueError):
  """A folder that cannot be loaded (neither a workdir nor an export, or weights that do not fit
  the model of its config.json); the message names the first problem and the fix."""


is_export = export_lib.is_export  # (the format's reader beside its writer)


def load(path: str, *, step: int | None = None) -> "LoadedModel":
  """The model, tokenizer and config of a training workdir (its latest checkpoint, or `step`) or
  of a folder `python -m efficient_lm.export` wrote (or any folder holding `model.safetensors` or
  `model.safetensors.index.json` with a config.json and a tokenizer file)."""
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise LoadError(f"{path} is not a folder; give a training workdir or a folder "
                    "`python -m efficient_lm.export` wrote")
  if is_export(path):
    if step is not None:
      raise LoadError(f"step={step}: {path} is an export, which holds one step; leave step out, or "
                      "load the workdir it came from")
    return _load_export(path)
  if os.path.isfile(os.path.join(path, workdir_lib.CONFIG)):
    try:
      graphdef, params, config, step = export_lib.restore(path, step)
    except (workdir_lib.WorkdirError, export_lib.ExportError,
            checkpoint.NoRestorableCheckpointError) as e:
      raise LoadError(str(e)) from e
    return LoadedModel(nnx.merge(graphdef, params), _open_tokenizer(path), config, step, path)
  raise LoadError(f"{path} holds neither {export_lib.WEIGHTS} (an export) nor {workdir_lib.CONFIG} "
                  "and checkpoints/ (a training workdir); give one of those folders")


def _open_tokenizer(path: str):
  """The tokenizer of a workdir or an export folder (its tokenizer.model or tokenizer.json, with
  the separator its run's config.json names)."""
  if not any(os.path.isfile(os.path.join(path, name)) for name in workdir_lib.TOKENIZER_FILES):
    raise LoadError(f"{path} has no tokenizer file ({' or '.join(workdir_lib.TOKENIZER_FILES)}); "
                    "copy the tokenizer the model was trained with into it")
  return open_tokenizer(path)


def _read_config(path: str) -> tuple[ml_collections.ConfigDict, dict]:
  """(config, its format block: {} for a config.json written elsewhere) of an export folder."""
  file = os.path.join(path, workdir_lib.CONFIG)
  try:
    with open(file, encoding="utf-8") as f:
      raw = json.load(f)
  except (OSError, ValueError) as e:
    raise LoadError(f"{file} cannot be read as JSON ({e}); an export needs the run's config.json "
                    "(`python -m efficient_lm.export` writes it)") from e
  fmt = raw.pop("format", None) or {}
  if fmt.get("name") == export_lib.FORMAT and fmt.get("version", 0) > export_lib.FORMAT_VERSION:
    raise LoadError(f"{file} is export format version {fmt['version']}, newer than this library "
                    f"reads ({export_lib.FORMAT_VERSION}); update efficient_lm")
  if "model" not in raw or "name" not in raw.get("model", {}):
    raise LoadError(f"{file} has no model section with a name; give the run's config.json (a "
                    "workdir's, or what `python -m efficient_lm.export` wrote)")
  return config_base.fill_defaults(ml_collections.ConfigDict(raw), saved=True), fmt


def _weight_files(path: str) -> dict[str, str]:
  """{tensor name: file} of an export folder, from its index (sharded) or its single file."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  index = os.path.join(path, export_lib.INDEX)
  if os.path.isfile(index):
    try:
      with open(index, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise LoadError(f"{index} has no readable weight_map ({type(e).__name__}: {e}); rewrite it "
                      "as {\"metadata\": {...}, \"weight_map\": {name: file}}") from e
    files = sorted(set(weight_map.values()))
  else:
    weight_map, files = None, [export_lib.WEIGHTS]
  where = {}
  for file in files:
    full = os.path.join(path, file)
    if not os.path.isfile(full):
      raise LoadError(f"{full} is missing ({export_lib.INDEX} maps tensors to it); copy the whole "
                      "export folder")
    with safe_open(full, framework="numpy") as f:
      for name in f.keys():
        if name in where:
          raise LoadError(f"tensor {name!r} is in both {where[name]} and {file}; keep one")
        where[name] = file
  if weight_map is not None:
    for name, file in weight_map.items():
      if where.get(name) != file:
        raise LoadError(f"{export_lib.INDEX} maps tensor {name!r} to {file}, which does not hold "
                        "it; rewrite the index from the files")
  return where


def _check_tensors(path: str, where: dict[str, str], expected: dict) -> None:
  """A LoadError naming the first missing or unexpected tensor, or the first of another shape or
  kind of dtype (a floating tensor loads into a floating parameter of any width)."""
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


def _load_export(path: str) -> "LoadedModel":
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  config, fmt = _read_config(path)
  tokenizer = _open_tokenizer(path)
  device = jax.devices()[0]
  config = export_lib.runnable_config(config, device.platform)
  built = train_state.build(config, export_lib.one_device_mesh(device), abstract=True)
  expected = export_lib.flat_names(built.state.params)
  where = _weight_files(path)
  _check_tensors(path, where, expected)
  pure = nnx.to_pure_dict(built.state.params)
  with contextlib.ExitStack() as stack:
    files = {file: stack.enter_context(safe_open(os.path.join(path, file), framework="numpy"))
             for file in sorted(set(where.values()))}
    for name, (keys, want) in expected.items():
      node = pure
      for key in keys[:-1]:
        node = node[key]
      array = np.asarray(files[where[name]].get_tensor(name)).astype(want.dtype)
      node[keys[-1]] = jax.device_put(array, want.sharding)
  params = built.state.params
  nnx.replace_by_pure_dict(params, pure)
  return LoadedModel(nnx.merge(built.graphdef, params), tokenizer, config, fmt.get("step"), path)


class LoadedModel:
  """A trained model with its tokenizer and config (`load`).

  Attributes: `model` (the nnx module), `tokenizer`, `config` (the run's), `step` (the
  checkpoint's; None for an export written elsewhere without one), `seq_len` (the context the
  model was trained on), `eos_id` (the end-of-document id that starts every document), `path`.
  """

  def __init__(self, model: nnx.Module, tokenizer, config: ml_collections.ConfigDict,
               step: int | None, path: str):
    self.model = model
    self.tokenizer = tokenizer
    self.config = config
    self.step = step
    self.path = path
    self.seq_len = int(config.model.seq_len)
    self.eos_id = int(tokenizer.eos_id)
    self._graphdef, self._params = nnx.split(model)
    self._score_step = None
    graphdef = self._graphdef

    @jax.jit
    def logits(params, tokens_BT, segment_ids_BT):
      model = nnx.merge(graphdef, params)
      return model(tokens_BT, segment_ids_BT=segment_ids_BT).astype(jnp.float32)

    self._logits = logits  # one compile per input shape

  @property
  def num_params(self) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(self._params))

  def __repr__(self) -> str:
    return (f"LoadedModel({self.config.model.name} at step {self.step} from {self.path}: "
            f"{self.num_params:,} parameters, seq_len {self.seq_len})")

  # Logits.

  def logits(self, token_ids) -> np.ndarray:
    """float32 `[B, T', V]` logits for int token ids `[B, T]` (T <= seq_len): every position, or
    the last T' a Perceiver-AR model predicts. Give each document's end-of-document token
    (`eos_id`) before it, as training did; with `data.document_mask` (the default) the positions
    attend within the documents those tokens delimit, as in training."""
    ids_BT = np.asarray(token_ids)
    if ids_BT.ndim != 2 or not np.issubdtype(ids_BT.dtype, np.integer) or 0 in ids_BT.shape:
      raise ValueError(f"token_ids must be a non-empty int array [batch, tokens] (got shape "
                       f"{ids_BT.shape}, dtype {ids_BT.dtype}); wrap one sequence as [ids]")
    if ids_BT.shape[1] > self.seq_len:
      raise ValueError(f"token_ids has {ids_BT.shape[1]} tokens a row, more than the model's "
                       f"seq_len={self.seq_len}; cut the rows, or use .score, which windows long "
                       "texts")
    vocab = int(self.config.model.vocab_size)
    if ids_BT.min() < 0 or ids_BT.max() >= vocab:
      bad = ids_BT.min() if ids_BT.min() < 0 else ids_BT.max()
      raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab}); encode "
                       "text with .tokenizer")
    ids_BT = ids_BT.astype(np.int32)
    segments_BT = None
    if self.config.data.document_mask:
      segments_BT = jnp.asarray(corpus_lib.document_ids(ids_BT, self.eos_id))
    return np.asarray(self._logits(self._params, jnp.asarray(ids_BT), segments_BT))

  # Scoring.

  def score(self, texts: Sequence[str], *, batch_size: int | None = None) -> dict:
    """Loss (nats/token), perplexity and bits per byte of each text and of all of them together.

    Each text is one document, scored as `python -m efficient_lm.evaluate --text_file` scores a
    file: the stream [eos] + its tokens + [eos], in windows of `seq_len` tokens, every target
    once, through `scoring`'s windows and score step (compiled once for all the texts; the
    windows are built a batch at a time, so any number of texts fits).
    Returns {"texts": [{loss, perplexity, bits_per_byte, tokens, bytes}, ...], and the same
    figures over all texts}; `tokens` counts the scored targets. Bits per byte is None, with
    `bits_per_byte_reason`, where the tokenizer does not give the text back (`data.round_trip`).
    A call longer than 20 s says how far it is on stderr (`progress.phase`)."""
    if isinstance(texts, str):
      raise ValueError("texts must be a list of strings; wrap one text as [text]")
    texts = list(texts)
    if not texts:
      raise ValueError("texts is empty; give at least one text to score")
    batch_size = batch_size or int(self.config.data.batch_size)
    scoring._check_positive_int("batch_size", batch_size)  # pylint: disable=protected-access
    seq_len, eos, pad = self.seq_len, self.eos_id, int(self.tokenizer.pad_id)
    num_logits = scoring.predicted_positions(self.model, seq_len)
    scoring.check_windows(seq_len, seq_len, seq_len=seq_len, num_logits=num_logits,
                          model_name=f"model.name={self.config.model.name!r}")
    if self._score_step is None:
      self._score_step = scoring.make_score_step(
          self._graphdef, loss_chunk=self.config.train.loss_chunk, per_token=True)
    layout = dict(context=seq_len, stride=seq_len, seq_len=seq_len, right_align=False, eos_id=eos,
                  pad_id=pad, document_mask=bool(self.config.data.document_mask))
    for i, text in enumerate(texts):  # every refusal before any work
      if not isinstance(text, str) or not text:
        raise ValueError(f"texts[{i}] is {'empty' if text == '' else type(text).__name__}; give "
                         "non-empty strings")
    nll_N, scored_N = np.zeros(len(texts)), np.zeros(len(texts))  # per text, float64 on the host
    targets, num_bytes, measured = [], [], []
    pending, owners = [], []  # rows not yet scored, a batch at a time, and their texts

    def run(rows: dict, owner_R: np.ndarray) -> None:
      if len(owner_R) < batch_size:  # the last batch: rows of weight 0 (window ids past the end)
        extra = scoring.window_batch(np.asarray([eos, eos], np.int32),
                                     np.arange(1, 1 + batch_size - len(owner_R)), **layout)
        rows = {k: np.concatenate([rows[k], extra[k]]) for k in rows}
      out = jax.device_get(self._score_step(self._params, rows))
      T = out["token_nll"].shape[1]
      weights_RT = rows["weights"][:len(owner_R), -T:]
      token_nll_RT = np.asarray(out["token_nll"], np.float64)[:len(owner_R)]
      np.add.at(nll_N, owner_R, (token_nll_RT * weights_RT).sum(1))
      np.add.at(scored_N, owner_R, weights_RT.sum(1))

    status = lambda: (f"{len(targets):,} of {len(texts):,} texts read, "
                      f"{int(scored_N.sum()):,} tokens scored")
    with progress.phase(f"scoring {len(texts):,} text(s)", status=status):
      for i, text in enumerate(texts):
        tokens = np.concatenate([[eos], self.tokenizer.encode(text), [eos]]).astype(np.int32)
        windows = scoring.num_windows(len(tokens) - 1, seq_len)
        pending.append(scoring.window_batch(tokens, np.arange(windows), **layout))
        owners.append(np.full(windows, i))
        targets.append(len(tokens) - 1)
        num_bytes.append(len(text.encode("utf-8")))
        measured.append(round_trip.measure(self.tokenizer, tokens, [text]))
        while sum(map(len, owners)) >= batch_size or (i == len(texts) - 1 and owners):
          rows = {k: np.concatenate([b[k] for b in pending]) for k in pending[0]}
          owner_R = np.concatenate(owners)
          run({k: v[:batch_size] for k, v in rows.items()}, owner_R[:batch_size])
          rest = {k: v[batch_size:] for k, v in rows.items()}
          left = len(owner_R) > batch_size
          pending, owners = ([rest], [owner_R[batch_size:]]) if left else ([], [])
    per_text, total_nll, total_scored, total_bytes = [], 0.0, 0.0, 0.0
    for i in range(len(texts)):
      nll, scored = float(nll_N[i]), float(scored_N[i])
      charged = num_bytes[i] * scored / targets[i]  # bytes of the scored share (latents only)
      per_text.append({**metrics_lib.loss_figures(nll, scored, charged,
                                                  round_trip.withheld(measured[i], "scored")),
                       "tokens": int(round(scored)), "bytes": num_bytes[i]})
      total_nll, total_scored, total_bytes = (total_nll + nll, total_scored + scored,
                                              total_bytes + charged)
    withheld = round_trip.withheld(round_trip.total(measured), "scored")
    return {"texts": per_text, **metrics_lib.loss_figures(total_nll, total_scored, total_bytes,
                                                          withheld),
            "tokens": int(round(total_scored)), "bytes": int(sum(num_bytes))}

  # Generation.

  def generate(self, prompts, max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 40,
               top_p: float = 1.0, seed: int = 0, stop: Sequence[str] | None = None):
    """The continuation of each prompt (the new text only), all prompts decoded together by
    `generation.generate_batch` (the cached decoder): up to `max_new_tokens` tokens, `temperature`
    0 = greedy, `top_k` 0 and `top_p` 1 = no cut; each prompt a document's start. A continuation
    ends at the end-of-document token (not in the text) or once it holds a string of `stop` (cut
    before it: `generation.generate_texts`, whose `tokens` end with the token that completed it).
    A list of prompts gives a list of texts; one string, one text. A call longer than 20 s says
    how far it is on stderr (`progress.phase`)."""
    one = isinstance(prompts, str)
    prompts = [prompts] if one else list(prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
      raise ValueError("prompts must be a string or a non-empty list of strings")
    generation.check_sampling(temperature, top_k, top_p)
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
      raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stop):
      raise ValueError(f"stop={stop!r} must be non-empty strings")
    texts = [g.continuation for g in generation.generate_texts(
        self.model, self.tokenizer, prompts, num_tokens=max_new_tokens,
        document_mask=bool(self.config.data.document_mask), seed=seed, temperature=temperature,
        top_k=top_k, top_p=top_p, stop=stop)]
    return texts[0] if one else texts


__all__ = ["LoadError", "LoadedModel", "is_export", "load"]
