"""Evaluation of a trained workdir: loss, perplexity and bits per byte on a split or a text file.

    python -m efficient_lm.evaluate --workdir=runs/pi_attention [--split=test | --text_file=PATH]
        [--context=N --stride=S] [--per_position] [--batch_size=B] [--out=DIR]

Windows. A token stream of n targets (stream[i + 1] is the target of input
position i) is cut into windows of up to `context` = N inputs moving by
`stride` = S: window w covers input positions [w*S - (N - S), w*S + S), clipped
at 0 and at n, and scores only its last S targets (the first window all of
its own), so every target is scored exactly once, with up to N - 1 tokens of
context before it. N = S = the model's seq_len (the default) are the training
eval's non-overlapping windows (`train.evaluate`); S < N is the overlapping
evaluation LMs are usually compared with. Every window is fed to the model as
exactly seq_len tokens: a causal model gets it at the start, padded after
(padding it never sees); a model whose logits cover only the last Z positions
(the Perceiver-AR family: its latents) gets it right-aligned after
end-of-document tokens, so its last S <= Z targets fall on latents. With the
default windows (N = S = seq_len > Z) such a model is laid out as in training
and scores only the last Z targets of each window; it is charged the bytes of
what it scored (bytes x scored / targets), as `train.evaluate` does.

`score_stream` scores any token stream with a model; `evaluate_workdir` loads a
workdir (config, tokenizer, latest checkpoint) and scores a split of its corpus
or a UTF-8 file (one document: [eos] + ids + [eos]) over a data-parallel mesh
of every local device (batch rows sharded, parameters replicated).
"""

import json
import math
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from efficient_lm import metrics as metrics_lib
from efficient_lm import sharding


class EvalError(ValueError):
  """An evaluation that cannot run as asked (bad windows, split or file); the message says why."""


# ----------------------------------------------------------------------------------------------
# Windows and the scoring step.


def _check_positive_int(name: str, value: Any) -> None:
  if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1):
    raise EvalError(f"{name}={value!r} must be a positive integer; set --{name} to an integer >= 1")


def check_windows(context: int, stride: int, *, seq_len: int, num_logits: int, model_name: str = "the model"
                  ) -> None:
  """Clear errors for `context` / `stride` against a model of `seq_len` inputs and `num_logits`
  predicted positions (the last ones; < seq_len for the Perceiver-AR family)."""
  _check_positive_int("context", context)
  _check_positive_int("stride", stride)
  if stride > context:
    raise EvalError(f"stride={stride} must be at most context={context} (each window scores its "
                    f"last stride targets); set --stride to at most {context}")
  if context > seq_len:
    raise EvalError(f"context={context} exceeds model.seq_len={seq_len}, the window {model_name} was "
                    "trained on (learned positions, fixed windows and latents cannot go past it); "
                    f"set --context to at most {seq_len}")
  if num_logits < seq_len and stride > num_logits and not context == stride == seq_len:
    raise EvalError(f"stride={stride} exceeds model.num_latents={num_logits}: {model_name} predicts "
                    f"only the last {num_logits} positions of a window, so each window can score at "
                    f"most {num_logits} targets; set --stride to at most {num_logits} (every token "
                    "scored once), or leave --context and --stride at seq_len for the training "
                    "eval's windows (latents only)")


def predicted_positions(model: nnx.Module, seq_len: int) -> int:
  """How many (last) positions of a `seq_len` window the model predicts: seq_len, or Z (latents)."""
  graphdef, params = nnx.split(model)
  return jax.eval_shape(lambda p, x: nnx.merge(graphdef, p)(x), params,
                        jax.ShapeDtypeStruct((1, seq_len), jnp.int32)).shape[1]


def num_windows(num_targets: int, stride: int) -> int:
  return -(-num_targets // stride)


def window_batch(tokens: np.ndarray, windows: np.ndarray, *, context: int, stride: int, seq_len: int,
                 right_align: bool, eos_id: int, pad_id: int) -> dict[str, np.ndarray]:
  """`[B, seq_len]` inputs, targets, weights (1 = scored) and window positions for window ids
  `windows` (ids past the last window give all-padding rows of weight 0)."""
  n = len(tokens) - 1
  w_B = np.asarray(windows, np.int64)
  real_B = w_B < num_windows(n, stride)
  first_B = w_B * stride                                   # first scored input position
  end_B = np.where(real_B, np.minimum(first_B + stride, n), 0)
  start_B = np.where(real_B, np.maximum(first_B - (context - stride), 0), 0)
  offset_B = seq_len - (end_B - start_B) if right_align else np.zeros_like(start_B)
  p_BT = start_B[:, None] + np.arange(seq_len, dtype=np.int64)[None, :] - offset_B[:, None]
  inside_BT = (p_BT >= start_B[:, None]) & (p_BT < end_B[:, None])
  scored_BT = inside_BT & (p_BT >= first_B[:, None])
  p_BT = np.clip(p_BT, 0, n - 1)
  fill = eos_id if right_align else pad_id
  return {
      "inputs": np.where(inside_BT, tokens[p_BT], fill).astype(np.int32),
      "targets": np.where(inside_BT, tokens[p_BT + 1], pad_id).astype(np.int32),
      "weights": scored_BT.astype(np.float32),
      "positions": np.where(inside_BT, p_BT - start_B[:, None], 0).astype(np.int32),
  }


def make_score_step(graphdef, num_positions: int = 0):
  """Jitted (params, batch) -> summed NLL (nats) and scored weight over the positions the logits
  cover (the last T'), plus per window position sums over `num_positions` bins when > 0."""

  @jax.jit
  def score_step(params, batch):
    logits_BTV = nnx.merge(graphdef, params)(batch["inputs"])
    T = logits_BTV.shape[1]
    weights_BT = batch["weights"][:, -T:]
    nll_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch["targets"][:, -T:])
    out = {"nll": jnp.sum(nll_BT * weights_BT), "scored": jnp.sum(weights_BT)}
    if num_positions:
      where_N = batch["positions"][:, -T:].reshape(-1)
      out["position_nll"] = jax.ops.segment_sum((nll_BT * weights_BT).reshape(-1), where_N,
                                                num_segments=num_positions)
      out["position_count"] = jax.ops.segment_sum(weights_BT.reshape(-1), where_N,
                                                  num_segments=num_positions)
    return out

  return score_step


def score_stream(model: nnx.Module, tokens, *, context: int, stride: int, batch_size: int,
                 num_bytes: int, eos_id: int, pad_id: int, per_position: bool = False,
                 mesh: jax.sharding.Mesh | None = None, seq_len: int | None = None) -> dict:
  """Scores every target of the 1-D token stream `tokens` once (see the module docstring).

  `num_bytes`: the UTF-8 bytes the stream's text holds (bits per byte's
  denominator). `seq_len`: the model's input length (default `model.seq_len`
  where the model has it, else `context`). `mesh`: a mesh with a `data` axis
  (and a `context` axis of size 1, as `sharding.shard_batch` expects) to shard
  batch rows over; `batch_size` must then be a multiple of its data size.
  Returns loss (nats/token), perplexity, bits_per_byte, scored_tokens,
  target_tokens (= len(tokens) - 1), num_windows, context and stride, and with
  `per_position` per_position_loss (None where nothing was scored) and
  per_position_count, one entry per window position 0..context-1.
  """
  tokens = np.asarray(tokens)
  if tokens.ndim != 1 or len(tokens) < 2:
    raise EvalError(f"tokens must be a 1-D stream of at least 2 ids (got shape {tokens.shape})")
  _check_positive_int("batch_size", batch_size)
  if not num_bytes > 0:
    raise EvalError(f"num_bytes={num_bytes!r} must be positive (the text's UTF-8 bytes)")
  seq_len = seq_len or getattr(model, "seq_len", None) or context
  graphdef, params = nnx.split(model)
  num_logits = predicted_positions(model, seq_len)
  check_windows(context, stride, seq_len=seq_len, num_logits=num_logits,
                model_name=type(model).__name__)
  data_size = 1 if mesh is None else mesh.shape["data"]
  if batch_size % data_size:
    raise EvalError(f"batch_size={batch_size} must be a multiple of the mesh's {data_size} data "
                    f"devices (rows are split over them); set --batch_size to a multiple of "
                    f"{data_size}")
  right_align = num_logits < seq_len and stride <= num_logits
  n = len(tokens) - 1
  total = num_windows(n, stride)
  if mesh is not None:
    params = jax.device_put(params, sharding.replicated(mesh))
  step = make_score_step(graphdef, context if per_position else 0)
  sums = {"nll": 0.0, "scored": 0.0, "position_nll": 0.0, "position_count": 0.0}
  pending: list = []

  def collect(output) -> None:  # host sums in float64, as train.evaluate's
    for name, value in jax.device_get(output).items():
      sums[name] = sums[name] + np.asarray(value, np.float64)

  for first in range(0, total, batch_size):
    batch = window_batch(tokens, np.arange(first, first + batch_size), context=context,
                         stride=stride, seq_len=seq_len, right_align=right_align, eos_id=eos_id,
                         pad_id=pad_id)
    placed = sharding.shard_batch(batch, mesh) if mesh is not None else batch
    pending.append(step(params, placed))  # dispatched asynchronously: the host builds the next
    if len(pending) > 4:
      collect(pending.pop(0))
  for output in pending:
    collect(output)
  total_nll, scored = float(sums["nll"]), float(sums["scored"])
  loss = total_nll / max(scored, 1.0)
  result = {"loss": loss, "perplexity": math.exp(min(loss, 80.0)),
            "bits_per_byte": metrics_lib.bits_per_byte(total_nll, num_bytes * scored / n),
            "scored_tokens": int(round(scored)), "target_tokens": n, "num_windows": total,
            "context": int(context), "stride": int(stride)}
  if per_position:
    position_nll, counts = sums["position_nll"], sums["position_count"]
    result["per_position_loss"] = [float(s / c) if c else None for s, c in zip(position_nll, counts)]
    result["per_position_count"] = [int(round(c)) for c in counts]
  return result


# ----------------------------------------------------------------------------------------------
# Workdirs, splits and files.


def read_text_file(path: str, tokenizer) -> tuple[np.ndarray, int]:
  """(stream = [eos] + ids + [eos], UTF-8 bytes) of a UTF-8 text file, read as one document."""
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise EvalError(f"--text_file={path} cannot be read ({e.strerror or e}); give a readable "
                    "UTF-8 text file") from e
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise EvalError(f"--text_file={path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                    f"{e.start}); convert it to UTF-8") from e
  if not raw:
    raise EvalError(f"--text_file={path} is empty; give a file with some text")
  ids = tokenizer.encode(text)
  eos = np.asarray([tokenizer.eos_id], np.int32)
  return np.concatenate([eos, ids, eos]), len(raw)


def data_parallel_mesh() -> jax.sharding.Mesh:
  """A `data` x `context` = (every local device) x 1 mesh: batch rows sharded."""
  devices = jax.local_devices()
  return jax.make_mesh((len(devices), 1), ("data", "context"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices)


def _load(workdir: str):
  """(model, tokenizer, config, step): the one place a workdir is loaded."""
  from efficient_lm import sample  # pylint: disable=import-outside-toplevel
  return sample.load_workdir(workdir)


def _source(config, tokenizer, split: str | None, text_file: str | None):
  """(name, token stream, bytes) of what to score."""
  if text_file is not None:
    tokens, num_bytes = read_text_file(text_file, tokenizer)
    return os.path.splitext(os.path.basename(text_file))[0] or "text", tokens, num_bytes
  from efficient_lm import data  # pylint: disable=import-outside-toplevel
  corpus = data.load(config.data)
  split = split or config.train.eval_split
  if split not in corpus.splits:
    raise EvalError(f"--split={split} is not a split of {corpus.name}; use one of "
                    f"{', '.join(corpus.splits)}")
  return split, corpus.tokens(split), corpus.num_bytes(split)


def evaluate_workdir(workdir: str, *, split: str | None = None, text_file: str | None = None,
                     context: int | None = None, stride: int | None = None,
                     batch_size: int | None = None, per_position: bool = False,
                     out: str | None = None) -> dict:
  """Scores the workdir's latest checkpoint on `split` (default `train.eval_split`) or on
  `text_file`, over every local device.

  `context` defaults to the model's seq_len, `stride` to `context`, `batch_size`
  to `data.batch_size` rounded up to a multiple of the device count. Returns
  `score_stream`'s figures plus model, step, what was scored (`split` or
  `text_file`), num_bytes and devices; with `per_position` also writes
  per_position.json and per_position.png into `out` (default
  `<workdir>/eval/<split or file stem>/`), named in the result as `out`.
  """
  if split is not None and text_file is not None:
    raise EvalError(f"--split={split} and --text_file={text_file} are both given; give one of them")
  for name, value in (("context", context), ("stride", stride), ("batch_size", batch_size)):
    if value is not None:
      _check_positive_int(name, value)
  workdir = os.path.abspath(os.path.expanduser(workdir))
  model, tokenizer, config, step = _load(workdir)
  seq_len = config.model.seq_len
  context = context or seq_len
  stride = stride or context
  check_windows(context, stride, seq_len=seq_len, num_logits=predicted_positions(model, seq_len),
                model_name=f"model.name={config.model.name!r}")
  name, tokens, num_bytes = _source(config, tokenizer, split, text_file)
  mesh = data_parallel_mesh()
  devices = mesh.shape["data"]
  if batch_size is None:
    batch_size = -(-config.data.batch_size // devices) * devices
  elif batch_size % devices:
    raise EvalError(f"batch_size={batch_size} must be a multiple of the {devices} local devices "
                    f"(rows are split over them); set --batch_size to a multiple of {devices}")
  result = score_stream(model, tokens, context=context, stride=stride, batch_size=batch_size,
                        num_bytes=num_bytes, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                        per_position=per_position, mesh=mesh, seq_len=seq_len)
  where = {"text_file": os.path.abspath(text_file)} if text_file is not None else {"split": name}
  result = {"model": config.model.name, "step": int(step), **where, **result,
            "num_bytes": int(num_bytes), "devices": devices}
  if per_position:
    out = out or os.path.join(workdir, "eval", name)
    write_per_position(result, out)
    result["out"] = os.path.abspath(out)
  return result


def write_per_position(result: dict, out: str) -> None:
  """per_position.json (mean loss and count at each window position) and per_position.png."""
  os.makedirs(out, exist_ok=True)
  what = result.get("split") or os.path.basename(result.get("text_file", ""))
  record = {k: result[k] for k in ("model", "step", "context", "stride", "loss") if k in result}
  record.update({"what": what, "position": list(range(len(result["per_position_loss"]))),
                 "loss_at_position": result["per_position_loss"],
                 "count_at_position": result["per_position_count"]})
  with open(os.path.join(out, "per_position.json"), "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1)
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  scored = [(i, v, c) for i, (v, c) in enumerate(zip(result["per_position_loss"],
                                                    result["per_position_count"])) if c]
  fig, (ax, counts_ax) = plt.subplots(2, 1, figsize=(7, 5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
  ax.plot([i for i, _, _ in scored], [v for _, v, _ in scored], lw=1)
  ax.set_ylabel("mean loss (nats/token)")
  ax.set_title(f"{result.get('model', '')} step {result.get('step', '')} on {what}: context "
               f"{result['context']}, stride {result['stride']}")
  ax.grid(alpha=0.3)
  counts_ax.plot([i for i, _, _ in scored], [c for _, _, c in scored], lw=1, color="gray")
  counts_ax.set_ylim(bottom=0)
  counts_ax.set_ylabel("scored tokens")
  counts_ax.set_xlabel("position in the window (tokens of context before the target)")
  counts_ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "per_position.png"), dpi=120)
  plt.close(fig)


# ----------------------------------------------------------------------------------------------
# The command line.


def cli(*, workdir: str, split: str | None = None, text_file: str | None = None,
        context: int | None = None, stride: int | None = None, batch_size: int | None = None,
        per_position: bool = False, out: str | None = None) -> int:
  """What the command does: a human line on stderr, the figures as the last stdout line (JSON);
  returns the exit status (2 and one `error: ...` line for input it cannot use)."""
  from efficient_lm import data, sample  # pylint: disable=import-outside-toplevel
  from efficient_lm.validation import ConfigError  # pylint: disable=import-outside-toplevel
  try:
    result = evaluate_workdir(workdir, split=split, text_file=text_file, context=context,
                              stride=stride, batch_size=batch_size, per_position=per_position,
                              out=out)
  except (EvalError, sample.WorkdirError, ConfigError, data.DataError, data.DownloadError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  what = result.get("split") or result["text_file"]
  latents = "" if result["scored_tokens"] == result["target_tokens"] else (
      f" (the model predicts only its latents: {result['scored_tokens']:,} of "
      f"{result['target_tokens']:,} targets scored, charged that share of the bytes)")
  print(f"{result['model']} at step {result['step']} on {what}: loss {result['loss']:.4f} "
        f"nats/token, perplexity {result['perplexity']:.2f}, {result['bits_per_byte']:.4f} bits/byte "
        f"over {result['scored_tokens']:,} tokens (context {result['context']}, stride "
        f"{result['stride']}, {result['devices']} device(s)){latents}", file=sys.stderr)
  if "out" in result:
    print(f"per-position loss: {result['out']}/per_position.json and per_position.png",
          file=sys.stderr)
  figures = {k: v for k, v in result.items() if not k.startswith("per_position")}
  sys.stdout.write(json.dumps(figures) + "\n")
  return 0


def main(argv) -> None:
  from absl import flags, logging as absl_logging  # pylint: disable=import-outside-toplevel
  del argv
  FLAGS = flags.FLAGS
  absl_logging.set_verbosity(absl_logging.WARNING)  # the libraries' (Orbax) warnings only
  sys.exit(cli(workdir=FLAGS.workdir, split=FLAGS.split, text_file=FLAGS.text_file,
               context=FLAGS.context, stride=FLAGS.stride, batch_size=FLAGS.batch_size,
               per_position=FLAGS.per_position, out=FLAGS.out))


def _define_flags() -> None:
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("workdir", None, "A training workdir (config.json, tokenizer.model, checkpoints).")
  flags.DEFINE_string("split", None, "A split of the workdir's corpus; default its train.eval_split.")
  flags.DEFINE_string("text_file", None, "A UTF-8 text file to score instead, as one document.")
  flags.DEFINE_integer("context", None, "Inputs per window (at most the model's seq_len); default "
                       "seq_len.")
  flags.DEFINE_integer("stride", None, "Targets each window scores (at most --context); default "
                       "--context. Below it the windows overlap.")
  flags.DEFINE_bool("per_position", False, "Also write per_position.json and per_position.png.")
  flags.DEFINE_integer("batch_size", None, "Windows per step; default data.batch_size, rounded up "
                       "to a multiple of the device count.")
  flags.DEFINE_string("out", None, "Where --per_position writes; default <workdir>/eval/<split or "
                      "file stem>/.")
  flags.mark_flags_as_required(["workdir"])


def run() -> None:
  """The `efficient-lm-eval` console script."""
  from absl import app  # pylint: disable=import-outside-toplevel
  _define_flags()
  app.run(main)


if __name__ == "__main__":
  run()
