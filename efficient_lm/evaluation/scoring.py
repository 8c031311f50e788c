"""Scoring a trained model: loss, perplexity and bits per byte over windows of a token stream,
what its context is worth (`--ablate_context`), recall by distance (MQAR). The command line:
`efficient_lm.evaluate`.

`score_stream(model, tokens, context=N, stride=S, ...)` scores every target of a token stream once,
each window of up to N inputs scoring its last S targets (S <= N <= seq_len, else an `EvalError`),
through the one scoring loop (`score_rows`: the train step's chunked loss, no `[B, T, V]`
logits); with `ablate_context=A` it scores each token again with only its last A - S .. A - 1
tokens of its own context, the inputs before them swapped for text of another document of the
split (`ablate_method='swap'`, in distribution) or end-of-document tokens (`'eos'`).
`score_recall` scores an MQAR split per distance bin; `evaluate_workdir` loads a workdir and scores
a split of its corpus or a UTF-8 file. Details (windows, the Perceiver-AR layout, the ablation,
recall): docs/evaluation.md.
"""

import itertools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from efficient_lm import data
from efficient_lm.config.run import RunConfig
from efficient_lm.data import corpus as corpus_lib
from efficient_lm.data import mqar
from efficient_lm.data import registry
from efficient_lm.data import round_trip
from efficient_lm.evaluation import stats
from efficient_lm.evaluation.score_rows import make_score_step, score_rows  # (scoring's step)
from efficient_lm.inference import restore as restore_lib
from efficient_lm.parallel import sharding
from efficient_lm.runtime import figures
from efficient_lm.training import metrics as metrics_lib


class EvalError(ValueError):
  """An evaluation that cannot run as asked (bad windows, split or file); the message says why."""


ABLATE_METHODS = ("swap", "eos")  # what replaces the context beyond the cut (docs/evaluation.md)


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


def swap_starts(tokens: np.ndarray, windows: np.ndarray, *, context: int, stride: int, ablate: int,
                eos_id: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """For each window id, where its swapped-in text starts in `tokens` (the swap ablation): a run
  of as many tokens as the window has inputs more than `ablate` before its end, none of them in a
  document of the kept inputs or of the scored targets (documents: an end-of-document token starts
  one); where the split has no such run (a window across the boundary of a two-document split),
  none in a document of the scored targets, else none in the last target's document. Drawn
  uniformly among such runs with a generator seeded by (seed, window id), so the batching does not
  change it. Returns (starts, relaxed): -1 for windows with nothing to swap; relaxed[i] when the
  run avoids only the targets' documents. An `EvalError` when no run avoids even the last target's
  document (a split of one document)."""
  n = len(tokens) - 1
  doc_N = np.cumsum(tokens == eos_id)
  first_of_doc = np.searchsorted(doc_N, np.arange(doc_N[-1] + 2), side="left")
  out = np.full(len(windows), -1, np.int64)
  relaxed = np.zeros(len(windows), bool)
  for i, w in enumerate(np.asarray(windows, np.int64)):
    if w >= num_windows(n, stride):
      continue
    first, end = w * stride, min(w * stride + stride, n)
    start = max(first - (context - stride), 0)
    replaced = max(0, end - ablate - start)
    if not replaced:
      continue
    # The documents the run must avoid, strictest first: the kept inputs' and the targets', the
    # scored targets' (stream positions first + 1 .. end), the last target's.
    for level, lo_doc in enumerate((doc_N[end - ablate], doc_N[first + 1], doc_N[end])):
      hi_doc = doc_N[end]
      before = max(0, first_of_doc[lo_doc] - replaced + 1)          # runs ending before lo_doc
      after_start = first_of_doc[hi_doc + 1]                        # runs starting after hi_doc
      after = max(0, n + 1 - replaced - after_start + 1)
      if before + after:
        break
    else:
      raise EvalError(f"ablate_method='swap' needs {replaced} tokens of text from another document "
                      f"of the split for window {w}, and the split has none (its other documents "
                      f"are too short or missing); score a split with more documents, or use "
                      f"--ablate_method=eos")
    u = int(np.random.default_rng([seed, int(w)]).integers(before + after))
    out[i] = u if u < before else after_start + (u - before)
    relaxed[i] = level > 0
  return out, relaxed


def window_batch(tokens: np.ndarray, windows: np.ndarray, *, context: int, stride: int, seq_len: int,
                 right_align: bool, eos_id: int, pad_id: int, ablate: int = 0,
                 swap_from: np.ndarray | None = None,
                 document_mask: bool = False) -> dict[str, np.ndarray]:
  """`[B, seq_len]` inputs, targets, weights (1 = scored), window positions and stream positions
  (of each input; -1 outside) for window ids `windows` (ids past the last window give
  all-padding rows of weight 0). `ablate` = N > 0: every input more than N before the window's
  end is replaced: by the text of `tokens` starting at `swap_from[b]` (`swap_starts`), in order,
  or without `swap_from` by end-of-document tokens (docs/evaluation.md, Context ablation). With
  `document_mask`, the inputs' document ids as training saw them (`segment_ids`)."""
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
  stream_BT = np.where(inside_BT, p_BT, -1)
  p_BT = np.clip(p_BT, 0, n - 1)
  fill = eos_id if right_align else pad_id
  inputs_BT = np.where(inside_BT, tokens[p_BT], fill)
  if ablate:
    replaced_BT = inside_BT & (stream_BT < end_B[:, None] - ablate)
    if swap_from is None:
      inputs_BT = np.where(replaced_BT, eos_id, inputs_BT)
    else:
      donor_BT = np.clip(np.asarray(swap_from)[:, None] + p_BT - start_B[:, None], 0, n)
      inputs_BT = np.where(replaced_BT, tokens[donor_BT], inputs_BT)
  batch = {
      "inputs": inputs_BT.astype(np.int32),
      "targets": np.where(inside_BT, tokens[p_BT + 1], pad_id).astype(np.int32),
      "weights": scored_BT.astype(np.float32),
      "window_positions": np.where(inside_BT, p_BT - start_B[:, None], 0).astype(np.int32),
      "stream_positions": stream_BT.astype(np.int32),
  }
  if document_mask:
    batch["segment_ids"] = corpus_lib.document_ids(batch["inputs"], eos_id)
  return batch


def score_stream(model: nnx.Module, tokens, *, context: int, stride: int, batch_size: int,
                 num_bytes: int, eos_id: int, pad_id: int, per_position: bool = False,
                 mesh: jax.sharding.Mesh | None = None, seq_len: int | None = None,
                 loss_chunk: int = 0, ablate_context: int = 0, ablate_method: str = "swap",
                 buckets: int = 4, bootstrap_seed: int = 0, document_mask: bool = False,
                 bits_per_byte_withheld: str | None = None) -> dict:
  """Scores every target of the 1-D token stream `tokens` once (docs/evaluation.md, Windows).

  `num_bytes`: the UTF-8 bytes the stream's text holds (bits per byte's
  denominator); `bits_per_byte_withheld`: why bits per byte is null instead
  (a tokenizer that does not give the text back: `data.round_trip`). `seq_len`: the model's input length (default `model.seq_len`
  where the model has it, else `context`). `mesh`: a mesh with a `data` axis
  (and a `context` axis of size 1, as `sharding.shard_batch` expects) to shard
  batch rows over; `batch_size` must then be a multiple of its data size.
  `loss_chunk`: `train.loss_chunk` (positions per chunk of the head and loss).
  `document_mask`: the model attends within documents (`data.document_mask`).
  Returns loss (nats/token), perplexity, bits_per_byte, scored_tokens,
  target_tokens (= len(tokens) - 1), num_windows, context and stride, and with
  `per_position` per_position_loss (None where nothing was scored) and
  per_position_count, one entry per window position 0..context-1. With
  `ablate_context` = N: `ablation` (what the context beyond N is worth: the
  full and ablated losses, their mean per-token difference, its 95% bootstrap
  interval over documents and p-value, overall and in `buckets` log2 buckets of
  the position in the document: [0, N), [N, 2N), ...); `ablate_method`: what
  replaces that context, 'swap' (text of another document, `swap_starts`, seed
  `bootstrap_seed`) or 'eos' (end-of-document tokens).
  """
  tokens = np.asarray(tokens)
  if tokens.ndim != 1 or len(tokens) < 2:
    raise EvalError(f"tokens must be a 1-D stream of at least 2 ids (got shape {tokens.shape})")
  _check_positive_int("batch_size", batch_size)
  if not num_bytes > 0:
    raise EvalError(f"num_bytes={num_bytes!r}: the text scored has no bytes, nothing to score; "
                    "give a stream of some text and its UTF-8 bytes")
  seq_len = seq_len or getattr(model, "seq_len", None) or context
  graphdef, params = nnx.split(model)
  num_logits = predicted_positions(model, seq_len)
  check_windows(context, stride, seq_len=seq_len, num_logits=num_logits,
                model_name=type(model).__name__)
  if ablate_context:
    _check_positive_int("ablate_context", ablate_context)
    if ablate_method not in ABLATE_METHODS:
      raise EvalError(f"ablate_method={ablate_method!r} is not a known ablation; use "
                      f"{' or '.join(ABLATE_METHODS)} (--ablate_method)")
    if not stride <= ablate_context < context:
      raise EvalError(f"ablate_context={ablate_context} must be at least --stride={stride} (each "
                      f"scored token keeps ablate_context - stride .. ablate_context - 1 tokens of "
                      f"context) and below --context={context}; set it in [{stride}, {context})")
  data_size = 1 if mesh is None else math.prod(mesh.shape[a] for a in sharding.BATCH_AXES
                                                if a in mesh.shape)
  if batch_size % data_size:
    raise EvalError(f"batch_size={batch_size} must be a multiple of the mesh's {data_size} data "
                    f"devices (rows are split over them); set --batch_size to a multiple of "
                    f"{data_size}")
  right_align = num_logits < seq_len and stride <= num_logits
  n = len(tokens) - 1
  total = num_windows(n, stride)
  if mesh is not None:
    params = _on_mesh(params, mesh)
  step = make_score_step(graphdef, loss_chunk=loss_chunk)
  layout = dict(context=context, stride=stride, seq_len=seq_len, right_align=right_align,
                eos_id=eos_id, pad_id=pad_id, document_mask=document_mask)
  swap_relaxed = [0]  # windows whose swapped-in text avoids only the scored targets' documents

  def rows(ablate: int = 0):  # every window, built batch_size windows at a time
    for first in range(0, total, batch_size):
      windows = np.arange(first, min(first + batch_size, total))
      swap_from = None
      if ablate and ablate_method == "swap":
        swap_from, relaxed = swap_starts(tokens, windows, context=context, stride=stride,
                                         ablate=ablate, eos_id=eos_id, seed=bootstrap_seed)
        swap_relaxed[0] += int(relaxed.sum())
      block = window_batch(tokens, windows, ablate=ablate, swap_from=swap_from, **layout)
      yield from ({k: v[b] for k, v in block.items()} for b in range(len(windows)))

  loop = dict(batch_size=batch_size, pad_row={k: v[0] for k, v in window_batch(
      tokens, np.asarray([total]), **layout).items()},  # a window id past the last: weight 0
              place=(lambda b: sharding.shard_batch(b, mesh)) if mesh is not None else None)
  scored_rows = score_rows(step, params, rows(), progress=f"scoring {total:,} windows",
                           total=total, **loop)
  ablated_rows = (score_rows(step, params, rows(ablate_context), **loop) if ablate_context
                  else itertools.repeat(None))
  total_nll = scored = 0.0  # host sums in float64, as train.evaluate's
  position_nll, counts = np.zeros(context), np.zeros(context)
  kept = {"full": [], "ablated": [], "where": []}  # per scored token, for the ablation
  for full, ablated in zip(scored_rows, ablated_rows):
    total_nll, scored = total_nll + full.nll, scored + full.scored
    if per_position:
      full.add_positions(position_nll, counts)
    if ablated is not None:
      mask = full.weights > 0
      kept["full"].append(full.token_nll[mask])
      kept["ablated"].append(ablated.token_nll[mask])
      kept["where"].append(full.tail("stream_positions")[mask])
  result = {**metrics_lib.loss_figures(total_nll, scored, num_bytes * scored / n,
                                       bits_per_byte_withheld),
            "scored_tokens": int(round(scored)), "target_tokens": n, "num_windows": total,
            "context": int(context), "stride": int(stride)}
  if per_position:
    result["per_position_loss"] = [float(s / c) if c else None for s, c in zip(position_nll, counts)]
    result["per_position_count"] = [int(round(c)) for c in counts]
  if ablate_context:
    result["ablation"] = ablation_readout(
        np.concatenate(kept["full"]), np.concatenate(kept["ablated"]),
        np.concatenate(kept["where"]), tokens, eos_id, ablate_context, stride, buckets,
        bootstrap_seed)
    result["ablation"]["method"] = ablate_method
    if ablate_method == "swap":
      result["ablation"]["swap_relaxed_windows"] = swap_relaxed[0]
  return result


def ablation_readout(full_N, ablated_N, where_N, tokens, eos_id: int, ablate: int, stride: int,
                     buckets: int, seed: int) -> dict:
  """The context-ablation figures from per-token NLLs (scored tokens at stream input positions
  `where_N`): the mean full and ablated losses, the mean of ablated - full, its bootstrap interval
  over documents (a description of this run), per bucket of the position in the document."""
  starts = np.cumsum(tokens == eos_id)  # document number of each stream position
  document_N = starts[where_N]
  last_eos = np.maximum.accumulate(np.where(tokens == eos_id, np.arange(len(tokens)), 0))
  offset_N = where_N - last_eos[where_N]  # tokens of the document before the target's input

  def summarize(mask) -> dict:
    if not mask.any():
      return {"full_loss": None, "ablated_loss": None, "delta": None, "ci_low": None,
              "ci_high": None, "p_value": None, "tokens": 0, "documents": 0}
    test = stats.paired_bootstrap(full_N[mask], ablated_N[mask], groups=document_N[mask],
                                  num_resamples=2000, seed=seed)
    return {"full_loss": float(np.mean(full_N[mask])), "ablated_loss": float(np.mean(ablated_N[mask])),
            "delta": float(np.mean(ablated_N[mask] - full_N[mask])), "ci_low": test.ci_low,
            "ci_high": test.ci_high, "p_value": test.p_value, "tokens": int(mask.sum()),
            "documents": int(len(np.unique(document_N[mask])))}

  edges = [0] + [ablate * 2 ** i for i in range(buckets - 1)] + [np.inf]
  return {"ablate_context": int(ablate), "kept_context": [int(ablate - stride), int(ablate - 1)],
          "all": summarize(np.ones_like(where_N, bool)),
          "by_position_in_document": [
              {"low": int(lo), "high": None if hi == np.inf else int(hi),
               **summarize((offset_N >= lo) & (offset_N < hi))}
              for lo, hi in zip(edges[:-1], edges[1:])]}


def score_recall(model: nnx.Module, corpus, split: str, *, batch_size: int, loss_chunk: int = 0,
                 mesh: jax.sharding.Mesh | None = None, num_bins: int = 8,
                 per_query: bool = False) -> dict:
  """MQAR (`data.mqar`): the answers' loss and accuracy per distance bin (its standard error and
  queries per bin) over every sequence of `split`; with `per_query`, `queries`: every answer's
  sequence, position (its input position in the window), distance and correctness (arrays, for
  paired tests across models on the same queries)."""
  graphdef, params = nnx.split(model)
  if mesh is not None:
    params = _on_mesh(params, mesh)
  step = make_score_step(graphdef, loss_chunk=loss_chunk, predictions=True)
  accuracy = mqar.DistanceAccuracy(corpus.task, num_bins)
  total_nll = scored = 0.0
  queries = {"sequence": [], "position": [], "distance": [], "correct": []}
  rows = ({k: v[b] for k, v in batch.items()}  # (its last batch comes padded with weight-0 rows)
          for batch in corpus.eval_batches(split, batch_size=batch_size)
          for b in range(len(batch["inputs"])))
  place = (lambda b: sharding.shard_batch(b, mesh)) if mesh is not None else None
  for sequence, out in enumerate(score_rows(step, params, rows, batch_size=batch_size,
                                            place=place, progress=f"scoring {split}")):
    total_nll, scored = total_nll + out.nll, scored + out.scored
    distances_T = out.row["distances"]
    accuracy.add(distances_T[None], out.row["targets"][None], out.predicted[None])
    if per_query:
      T = len(out.predicted)
      answer_T = out.tail("distances") >= 0
      queries["sequence"].append(np.full(int(answer_T.sum()), sequence))
      queries["position"].append((len(distances_T) - T + np.arange(T))[answer_T])
      queries["distance"].append(out.tail("distances")[answer_T])
      queries["correct"].append((out.predicted == out.tail("targets"))[answer_T])
  result = {**metrics_lib.loss_figures(total_nll, scored, 0, "an MQAR task has no text: its "
                                       "figures are per answer (loss, recall)"),
            "scored_tokens": int(scored),
            "recall": accuracy.result()}
  if per_query:
    result["queries"] = {k: np.concatenate(v) for k, v in queries.items()}
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


def _on_mesh(params, mesh):
  """Parameters on `mesh`: as they are when already placed there (sharded), else replicated."""
  leaves = jax.tree.leaves(params)
  if leaves and all(getattr(x, "sharding", None) is not None and
                    getattr(x.sharding, "mesh", None) == mesh for x in leaves):
    return params
  return jax.device_put(params, sharding.replicated(mesh))


def _source(config: RunConfig, tokenizer, split: str | None, text_file: str | None):
  """(name, token stream, bytes, why bits per byte is withheld or None) of what to score: a split
  with no text is an EvalError; bits per byte is withheld where the tokenizer does not give the
  text back (`data.round_trip`)."""
  if text_file is not None:
    tokens, num_bytes = read_text_file(text_file, tokenizer)
    with open(text_file, "rb") as f:  # (read_text_file checked it is UTF-8)
      measured = round_trip.measure(tokenizer, tokens, [f.read().decode("utf-8")])
    return (os.path.splitext(os.path.basename(text_file))[0] or "text", tokens, num_bytes,
            round_trip.withheld(measured, "--text_file"))
  # the workdir's config.json, tokenized by the workdir's tokenizer, whatever the data cache holds
  corpus = data.load(data.validate(config.data), tokenizer_file=tokenizer.model_path)
  split = split or config.train.eval_split
  if split not in corpus.splits:
    raise EvalError(f"--split={split} is not a split of {corpus.name}; use one of "
                    f"{', '.join(corpus.splits)}")
  empty = data.without_text(corpus, split)
  if empty:
    others = [s for s in corpus.splits if s != split and not data.without_text(corpus, s)]
    raise EvalError(f"--split={split}: the {split} split of {corpus.name} {empty}, nothing to "
                    f"score; give --split another split ({', '.join(others) or 'none has text'}) "
                    "or a --text_file")
  return (split, corpus.tokens(split), corpus.num_bytes(split),
          data.bits_per_byte_withheld(corpus, split))


def evaluate_workdir(workdir: str, *, split: str | None = None, text_file: str | None = None,
                     context: int | None = None, stride: int | None = None,
                     batch_size: int | None = None, per_position: bool = False,
                     out: str | None = None, ablate_context: int = 0, ablate_method: str = "swap",
                     per_query: bool = False, max_tokens: int = 0) -> dict:
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
  # The parameters straight onto this host's devices, sharded as in training (a model that
  # needed FSDP to train is evaluated the same way).
  restored = restore_lib.restore(workdir, sharded=True, exports=False)
  model, tokenizer, config, step, mesh = (restored.model, restored.tokenizer, restored.config,
                                          restored.step, restored.mesh)
  if not registry.source(config.data.dataset).has_text and text_file is None:  # recall (MQAR)
    return _evaluate_recall(workdir, model, config, step, split, batch_size, per_query, mesh)
  seq_len = config.model.seq_len
  context = context or seq_len
  stride = stride or context
  check_windows(context, stride, seq_len=seq_len, num_logits=predicted_positions(model, seq_len),
                model_name=f"model.name={config.model.name!r}")
  name, tokens, num_bytes, withheld = _source(config, tokenizer, split, text_file)
  if max_tokens and max_tokens < len(tokens) - 1:  # the first documents holding max_tokens
    ends = np.flatnonzero(np.asarray(tokens) == tokenizer.eos_id)
    cut = int(ends[np.searchsorted(ends, max_tokens)]) if ends[-1] >= max_tokens else len(tokens) - 1
    num_bytes = num_bytes * cut / (len(tokens) - 1)  # estimated: bytes in proportion to tokens
    tokens = tokens[:cut + 1]
  devices = mesh.shape["fsdp"]
  if batch_size is None:
    batch_size = -(-config.data.batch_size // devices) * devices
  elif batch_size % devices:
    raise EvalError(f"batch_size={batch_size} must be a multiple of the {devices} local devices "
                    f"(rows are split over them); set --batch_size to a multiple of {devices}")
  result = score_stream(model, tokens, context=context, stride=stride, batch_size=batch_size,
                        num_bytes=num_bytes, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                        per_position=per_position, mesh=mesh, seq_len=seq_len,
                        loss_chunk=config.train.loss_chunk,
                        ablate_context=ablate_context or 0, ablate_method=ablate_method,
                        document_mask=config.data.document_mask, bits_per_byte_withheld=withheld)
  where = {"text_file": os.path.abspath(text_file)} if text_file is not None else {"split": name}
  result = {"model": config.model.name, "step": int(step), **where, **result,
            "num_bytes": int(num_bytes), "devices": devices}
  if per_position:
    out = out or os.path.join(workdir, "eval", name)
    write_per_position(result, out)
    result["out"] = os.path.abspath(out)
  return result


def _evaluate_recall(workdir: str, model: nnx.Module, config: RunConfig, step: int,
                     split: str | None, batch_size: int | None, per_query: bool,
                     mesh: jax.sharding.Mesh) -> dict:
  corpus = data.load(data.validate(config.data))  # the workdir's config.json
  split = split or config.train.eval_split
  if split not in corpus.splits or split == "train":
    raise EvalError(f"--split={split} is not an evaluation split of {corpus.name}; use validation "
                    "or test")
  devices = mesh.shape["fsdp"]
  batch_size = -(-(batch_size or config.data.batch_size) // devices) * devices
  result = score_recall(model, corpus, split, batch_size=batch_size, mesh=mesh,
                        loss_chunk=config.train.loss_chunk, per_query=per_query)
  return {"model": config.model.name, "step": int(step), "split": split, **result,
          "devices": devices, "dataset": config.data.dataset}


def write_per_position(result: dict, out: str) -> None:
  """per_position.json (mean loss and count at each window position) and per_position.png."""
  os.makedirs(out, exist_ok=True)
  what = result.get("split") or os.path.basename(result.get("text_file", ""))
  record = {k: result[k] for k in ("model", "step", "context", "stride", "loss") if k in result}
  record.update({"what": what, "position": list(range(len(result["per_position_loss"]))),
                 "loss_at_position": result["per_position_loss"],
                 "count_at_position": result["per_position_count"]})
  with open(os.path.join(out, "per_position.json"), "w", encoding="utf-8") as f:
    figures.dump(record, f, indent=1)
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
