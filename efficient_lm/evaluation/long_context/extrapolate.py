"""Loss by position at 1x, 2x, 4x, 8x the trained length (`--task=extrapolate`).

For each factor f the windows are L = f * seq_len inputs cut from inside the held-out split's
documents (each from a document's start, then every L tokens while the L targets stay in the
document), so window position p is a target with p tokens of its own document before it. They are
scored by `scoring`'s windows (`window_batch`) through the one scoring loop (`score_rows`), and
summed into log-spaced buckets of the position: [0, 1), [1, 2), [2, 4), ... [L/2, L).
"""

import os

import numpy as np
from flax import nnx

from efficient_lm.evaluation import score_rows
from efficient_lm.evaluation import scoring
from efficient_lm.evaluation.long_context import reach
from efficient_lm.evaluation.long_context import report
from efficient_lm.runtime import progress


class ExtrapolateError(ValueError):
  """An extrapolation curve that cannot be drawn as asked; the message names the flag and the fix."""


def window_starts(tokens: np.ndarray, eos_id: int, length: int) -> np.ndarray:
  """Where each window of `length` inputs (and its `length` targets) starts: inside one document,
  from its end-of-document token on, every `length` tokens; the last target may be the next
  document's end-of-document token."""
  ends = np.flatnonzero(np.asarray(tokens) == eos_id)
  starts = []
  for first, nxt in zip(ends, list(ends[1:]) + [len(tokens) - 1]):
    starts += list(range(int(first), int(nxt) - length + 1, length))
  return np.asarray(starts, np.int64)


def buckets(length: int) -> list[tuple[int, int]]:
  edges = [0] + [2 ** i for i in range(int(np.log2(length)) + 1)]
  if edges[-1] < length:
    edges.append(length)
  return list(zip(edges[:-1], edges[1:]))


def curve(model: nnx.Module, tokens, *, length: int, eos_id: int, pad_id: int, batch_size: int,
          document_mask: bool, loss_chunk: int = 0, max_windows: int = 0) -> dict:
  """Mean loss per position (window positions 0..length-1) over the windows `window_starts`
  gives, scored in batches of `batch_size` through the one scoring loop (`score_rows`): {loss,
  tokens, windows, position_loss, position_count, buckets: [{low, high, loss, tokens}]}."""
  tokens = np.asarray(tokens)
  starts = window_starts(tokens, eos_id, length)
  if max_windows:
    starts = starts[:max_windows]
  if not len(starts):
    raise ExtrapolateError(f"no document of the split holds {length} tokens; score a split (or "
                           f"--text_file) with longer documents, or smaller --factors")
  graphdef, params = nnx.split(model)
  step = score_rows.make_score_step(graphdef, loss_chunk=loss_chunk)
  layout = dict(context=length, stride=length, seq_len=length, right_align=False, eos_id=eos_id,
                pad_id=pad_id, document_mask=document_mask)
  one = lambda s, window: {k: v[0] for k, v in scoring.window_batch(
      tokens[s:s + length + 1], np.asarray([window]), **layout).items()}
  rows = (one(s, 0) for s in starts)  # a window of its own stream each
  nll, count = np.zeros(length), np.zeros(length)  # float64 on the host
  for row in score_rows.score_rows(step, params, rows, batch_size=batch_size,
                                   pad_row=one(starts[0], 1),  # past the stream's one window
                                   progress=f"{len(starts):,} windows of {length:,}",
                                   total=len(starts)):
    row.add_positions(nll, count)
  figures = []
  for lo, hi in buckets(length):
    c = count[lo:hi].sum()
    figures.append({"low": lo, "high": hi, "loss": float(nll[lo:hi].sum() / c) if c else None,
                    "tokens": int(round(c))})
  return {"length": length, "windows": int(len(starts)), "loss": float(nll.sum() / count.sum()),
          "tokens": int(round(count.sum())), "buckets": figures,
          "position_loss": [float(s / c) if c else None for s, c in zip(nll, count)],
          "position_count": [int(round(c)) for c in count]}


def run(lm, tokens, *, factors, batch_size: int, source: str, max_tokens: int = 0,
        log=print) -> dict:
  """Every factor's curve on `lm` (an `efficient_lm.load` model); lengths past the trained one
  only where the model's structure allows them (`reach`). How far it is goes to stderr every
  20 s (`progress.phase`)."""
  if not factors or any(not isinstance(f, int) or f < 1 for f in factors):
    raise ExtrapolateError(f"--factors={','.join(map(str, factors))} must be integers >= 1 "
                           "(multiples of model.seq_len), comma-separated")
  seq_len = lm.seq_len
  lengths = [f * seq_len for f in factors]
  warning = reach.check(lm.config, lengths, flag="--factors")
  if warning:
    log(warning)
  curves = []
  status = lambda: f"{len(curves)} of {len(factors)} factors done"
  with progress.phase(f"loss by position at {','.join(map(str, factors))} x seq_len",
                      status=status):
    for factor, length in zip(factors, lengths):
      rows = max(1, batch_size * seq_len // length)  # about the tokens of a training batch
      curves.append({"factor": factor, **curve(
          lm.model, tokens, length=length, eos_id=lm.eos_id, pad_id=int(lm.tokenizer.pad_id),
          batch_size=rows, document_mask=bool(lm.config.data.document_mask),
          loss_chunk=int(lm.config.train.loss_chunk),
          max_windows=max_tokens // length if max_tokens else 0)})
  return {"task": "extrapolate", "model": lm.config.model.name, "step": lm.step,
          "seq_len": seq_len, "path": lm.path, "what": source, "factors": list(factors),
          "curves": curves, "warning": warning}


def write(record: dict, out: str) -> tuple[str, str]:
  """extrapolate.json and extrapolate.png (mean loss per log-spaced position bucket, one curve a
  factor, with the trained length marked) into `out`."""
  json_path, png_path = os.path.join(out, "extrapolate.json"), os.path.join(out, "extrapolate.png")
  report.write_json(record, json_path)
  plt = report.pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for c in record["curves"]:
    points = [(max(b["low"], 0.5) if b["high"] == 1 else (b["low"] * b["high"]) ** 0.5, b["loss"])
              for b in c["buckets"] if b["loss"] is not None]
    ax.plot(*zip(*points), marker="o", ms=3, label=f"{c['factor']}x ({c['length']} tokens, "
                                                   f"{c['windows']} windows)")
  ax.axvline(record["seq_len"], color="gray", ls="--", lw=1, label="trained length")
  ax.set_xscale("log")
  ax.set_xlabel("position in the window (tokens of context before the target), log buckets")
  ax.set_ylabel("mean loss (nats/token)")
  ax.set_title(f"{record['model']} step {record['step']} on {record['what']}: loss by position")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
  return json_path, png_path


def result(record: dict, json_path: str, png_path: str) -> dict:
  """The stdout line's figures: each factor's overall loss and its last bucket (extrapolate.json
  holds every bucket and position), the files' paths."""
  curves = [{**{k: c[k] for k in ("factor", "length", "windows", "tokens", "loss")},
             "last_bucket": c["buckets"][-1]} for c in record["curves"]]
  return {**{k: record[k] for k in ("task", "model", "step", "seq_len", "what", "factors")},
          "curves": curves, "warning": record["warning"], "json": os.path.abspath(json_path),
          "png": os.path.abspath(png_path)}


def summary(record: dict, json_path: str) -> str:
  parts = []
  for c in record["curves"]:
    tail = c["buckets"][-1]
    parts.append(f"{c['factor']}x ({c['length']}): {c['loss']:.4f} over {c['tokens']:,} tokens, "
                 f"last bucket [{tail['low']}, {tail['high']}) "
                 f"{'-' if tail['loss'] is None else format(tail['loss'], '.4f')}")
  return (f"extrapolate {record['model']} step {record['step']} (trained {record['seq_len']}) on "
          f"{record['what']}: " + "; ".join(parts) + f"; {json_path}")
