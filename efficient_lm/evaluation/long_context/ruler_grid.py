"""RULER's tasks x lengths on a trained model: the prompts drawn (`ruler`), answered greedily in
batches of one shape per length (`generation.generate_batch`, as the needle grid answers), scored
(`ruler_score`); ruler.json, the heatmap ruler.png, and the figures of the one stdout line.

A cell the model cannot run (a length past what its positions or window take: `reach`, the one
place of that rule) is reported as skipped with the reason, never as a score of 0.
"""

import itertools
import os
import time

import numpy as np

from efficient_lm.config.run import RunConfig
from efficient_lm.evaluation import score_rows
from efficient_lm.evaluation.long_context import reach
from efficient_lm.evaluation.long_context import report
from efficient_lm.evaluation.long_context import ruler
from efficient_lm.evaluation.long_context import ruler_score
from efficient_lm.evaluation.long_context.ruler_fit import RulerError
from efficient_lm.inference import generation
from efficient_lm.runtime import progress


def check(tasks, lengths, samples: int, batch_size: int) -> None:
  """One `RulerError` line for flags that cannot run, before any prompt is drawn."""
  unknown = [t for t in tasks if t not in ruler.SPECS]
  if not tasks or unknown:
    raise RulerError(f"--ruler_tasks={','.join(tasks)}: {', '.join(unknown) or 'empty'} is not a "
                     f"RULER task; use some of {','.join(ruler.TASKS)}")
  if len(set(tasks)) < len(tasks):
    raise RulerError(f"--ruler_tasks={','.join(tasks)} names a task twice; name each once")
  if not lengths or any(not isinstance(n, int) or n < 2 for n in lengths):
    raise RulerError(f"--lengths={','.join(map(str, lengths))} must be integers >= 2 (tokens a "
                     "prompt), comma-separated")
  for name, value in (("samples", samples), ("batch_size", batch_size)):
    if value < 1:
      raise RulerError(f"--{name}={value} must be at least 1")


def skipped_cells(config: RunConfig, tasks, lengths) -> tuple[dict, str | None]:
  """({(task, length): why} for the cells the model cannot run, the warning for lengths past
  seq_len it runs out of distribution, or None): `reach.check` with each task's answer tokens."""
  skipped, warning = {}, None
  for length in lengths:
    for task in tasks:
      try:
        warning = reach.check(config, [length], extra=ruler.SPECS[task].new_tokens) or warning
      except reach.LengthError as e:
        skipped[(task, length)] = str(e)
  return skipped, warning


def draw(tokenizer, haystack, *, tasks, lengths, samples: int, seed: int = 0, skip=()) -> dict:
  """{(task, length): [Item, ...]}: `samples` prompts a cell, the cells of `skip` left out."""
  cells, done = {}, [0]
  total = len(tasks) * len(lengths) - len(skip)
  with progress.phase("drawing RULER prompts", status=lambda: f"{done[0]} of {total} cells"):
    for length in lengths:
      for task in tasks:
        if (task, length) not in skip:
          cells[(task, length)] = [ruler.build(tokenizer, task, length=length, index=i, seed=seed,
                                               haystack=haystack) for i in range(samples)]
          done[0] += 1
  return cells


def answer(lm, items: list, *, batch_size: int) -> list[str]:
  """The greedy answer text of each item (its first `new_tokens` new tokens, up to the
  end-of-document token), batches of `batch_size` rows of one token count (the last padded with
  copies: one compiled shape for the prompts of a length that fill it exactly)."""
  eos = int(lm.tokenizer.eos_id)
  budget = max(item.new_tokens for item in items)
  texts: list = [None] * len(items)
  order = sorted(range(len(items)), key=lambda i: -len(items[i].ids))
  done = [0]
  lengths = sorted({item.length for item in items})
  with progress.phase(f"answering {len(items)} RULER prompts of {','.join(map(str, lengths))} "
                      "tokens", status=lambda: f"{done[0]} of {len(items)} answered"):
    for _, group in itertools.groupby(order, key=lambda i: len(items[i].ids)):
      group = list(group)
      # a fixed shape, one compile per length: the last batch filled with the group's first
      for padded, real in score_rows.batches(group, batch_size, pad=group[0]):
        rows = padded[:real]
        new_ids = generation.generate_batch(
            lm.model, [items[i].ids for i in padded], num_tokens=budget, eos_id=eos,
            temperature=0.0, vocab_size=lm.tokenizer.vocab_size,
            document_mask=bool(lm.config.data.document_mask))
        for i, ids in zip(rows, new_ids):
          ids = ids[:items[i].new_tokens]
          texts[i] = lm.tokenizer.decode([t for t in ids if t != eos])
        done[0] += len(rows)
  return texts


def run(lm, haystack, *, tasks=ruler.TASKS, lengths, samples: int = 20, batch_size: int = 8,
        seed: int = 0, source: str = "", log=print) -> dict:
  """Every (task, length) cell on `lm` (an `efficient_lm.load` model), essay haystacks from
  `haystack` (held-out tokens, no end-of-document token): the record ruler.json holds."""
  tasks, lengths = list(tasks), list(lengths)
  check(tasks, lengths, samples, batch_size)
  skipped, warning = skipped_cells(lm.config, tasks, lengths)
  if warning:
    log(warning)
  cells = draw(lm.tokenizer, haystack, tasks=tasks, lengths=lengths, samples=samples, seed=seed,
               skip=skipped)
  seconds, figures = {}, {}
  for length in lengths:
    items = [item for task in tasks for item in cells.get((task, length), ())]
    if not items:
      continue
    began = time.time()
    texts = answer(lm, items, batch_size=batch_size)
    seconds[length] = time.time() - began
    for item, text in zip(items, texts):
      figures.setdefault((item.task, length), []).append(
          {"index": item.index, "tokens": len(item.ids) + 1, "expected": item.outputs,
           "answer": text, "score": ruler_score.string_match_all(text, item.outputs)})
    ran = [t for t in tasks if (t, length) in figures]
    log(f"ruler at {length} tokens: {len(items)} prompts of {len(ran)} tasks answered in "
        f"{seconds[length]:.0f} s")
  return _record(lm, tasks, lengths, samples, seed, source, figures, skipped, seconds, warning)


def _record(lm, tasks, lengths, samples, seed, source, figures, skipped, seconds, warning) -> dict:
  cells, scores = [], {task: {} for task in tasks}
  for task in tasks:
    for length in lengths:
      if (task, length) in skipped:
        cells.append({"task": task, "length": length, "skipped": skipped[(task, length)]})
        scores[task][str(length)] = None
        continue
      rows = figures[(task, length)]
      score = report.mean_interval([r["score"] for r in rows])
      cells.append({"task": task, "length": length, "score": score, "answers": rows})
      scores[task][str(length)] = score["mean"]
  # The average of a length over every task asked; none where a task was skipped there.
  average = {str(n): (None if any(scores[t][str(n)] is None for t in tasks)
                      else float(np.mean([scores[t][str(n)] for t in tasks]))) for n in lengths}
  return {"task": "ruler", "model": lm.config.model.name, "step": lm.step, "seq_len": lm.seq_len,
          "path": lm.path, "haystack": source, "tasks": tasks, "lengths": lengths,
          "samples": samples, "seed": seed, "scores": scores, "average": average,
          "skipped": [{"task": t, "length": n, "reason": why} for (t, n), why in skipped.items()],
          "cells": cells, "seconds_per_length": {str(k): round(v, 2) for k, v in seconds.items()},
          "warning": warning}


def write(record: dict, out: str) -> tuple[str, str]:
  """ruler.json and ruler.png (the heatmap: a row a task and the average, a column a length, the
  score in colour and in numbers, skipped cells grey) into `out`; returns their paths."""
  json_path, png_path = os.path.join(out, "ruler.json"), os.path.join(out, "ruler.png")
  report.write_json(record, json_path)
  plt = report.pyplot()
  rows = record["tasks"] + ["average"]
  lengths = record["lengths"]
  table = {**record["scores"], "average": record["average"]}
  grid = np.asarray([[np.nan if table[r][str(n)] is None else table[r][str(n)] for n in lengths]
                     for r in rows], np.float64)
  fig, ax = plt.subplots(figsize=(3.5 + 1.1 * len(lengths), 1.2 + 0.38 * len(rows)))
  cmap = plt.get_cmap("RdYlGn").with_extremes(bad="#cccccc")  # skipped cells grey
  image = ax.imshow(np.ma.masked_invalid(grid), vmin=0.0, vmax=1.0, cmap=cmap, aspect="auto")
  for i in range(len(rows)):
    for j in range(len(lengths)):
      ax.text(j, i, "skipped" if np.isnan(grid[i, j]) else f"{grid[i, j]:.2f}", ha="center",
              va="center", fontsize=8)
  ax.axhline(len(rows) - 1.5, color="black", linewidth=1)
  ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
  ax.set_yticks(range(len(rows)), rows)
  ax.set_xlabel("prompt length (the model's tokens)")
  ax.set_title(f"{record['model']} step {record['step']}: RULER, {record['samples']} a cell\n"
               f"(share of the expected strings in the greedy answer; haystack "
               f"{record['haystack']})", fontsize=9)
  fig.colorbar(image, ax=ax, fraction=0.04)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
  return json_path, png_path


def result(record: dict, json_path: str, png_path: str) -> dict:
  """The stdout line's figures: every task's score per length, the average, what was skipped."""
  keys = ("task", "model", "step", "lengths", "samples", "seed", "haystack", "scores", "average",
          "skipped", "warning")
  return {**{k: record[k] for k in keys}, "json": json_path, "png": png_path}


def summary(record: dict) -> str:
  """The human line on stderr."""
  means = ", ".join(f"{n}: {'-' if a is None else f'{a:.3f}'}" for n, a in record["average"].items())
  skipped = f"; {len(record['skipped'])} cells skipped" if record["skipped"] else ""
  return (f"ruler {record['model']} step {record['step']}: {len(record['tasks'])} tasks x "
          f"{len(record['lengths'])} lengths, {record['samples']} prompts a cell; average by "
          f"length {means}{skipped}")
