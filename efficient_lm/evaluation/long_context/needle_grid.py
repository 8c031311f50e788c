"""The needle grid: prompts for every (length, depth) cell, scored in fixed-size batches (one compile
per length), the figures per cell with their intervals, needle.json and the heatmap needle.png."""

import logging
import os
import time

import numpy as np

from efficient_lm.evaluation import score_rows
from efficient_lm.evaluation.long_context import needle as needle_lib
from efficient_lm.evaluation.long_context import reach
from efficient_lm.evaluation.long_context import report
from efficient_lm.inference import generation
from efficient_lm.runtime import progress

log_progress = logging.getLogger(__name__)

def _check(lengths, depths, needles_per_cell: int, variant: str, distractors: int,
           batch_size: int) -> None:
  if variant not in needle_lib.VARIANTS:
    raise needle_lib.NeedleError(f"--variant={variant!r} is not a needle variant; use one of "
                                 f"{', '.join(needle_lib.VARIANTS)}")
  if not lengths or any(not isinstance(n, int) or n < 2 for n in lengths):
    raise needle_lib.NeedleError(f"--lengths={','.join(map(str, lengths))} must be integers >= 2 "
                                 "(tokens a prompt), comma-separated")
  if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
    raise needle_lib.NeedleError(f"--depths={','.join(map(str, depths))} must be fractions in "
                                 "[0, 1] (0 = the haystack's start), comma-separated")
  for name, value in (("needles_per_cell", needles_per_cell), ("distractors", distractors),
                      ("batch_size", batch_size)):
    if value < 1:
      raise needle_lib.NeedleError(f"--{name}={value} must be at least 1")


def build_grid(tokenizer, haystack, *, lengths, depths, needles_per_cell: int, variant: str,
               distractors: int, seed: int = 0, key_words=None) -> dict:
  """{(length, depth): [(prompt, candidates, candidate ids), ...]}: every needle's prompt(s) and
  its candidate answers: the true ones first, then `distractors` others, the values of the
  haystack's other keys first (multikey, multiquery: what a model that ignores the key would
  answer), then random 7-digit values."""
  cells = {}
  for length in lengths:
    for di, depth in enumerate(depths):
      rows = []
      for i in range(needles_per_cell):
        rng = np.random.default_rng([seed, length, di, i])
        for prompt in needle_lib.build(tokenizer, haystack, length=length, depth=depth,
                                       variant=variant, rng=rng, group=i,
                                       key_words=key_words):
          seen = prompt.other_values[:distractors]
          wrong = seen + needle_lib.distractor_values(rng, prompt.answers + seen,
                                                      distractors - len(seen))
          question = needle_lib.QUESTION.format(key=prompt.key)
          q_ids = np.asarray(tokenizer.encode(question), np.int32)
          ids = list(prompt.answer_ids) + [needle_lib.answer_ids(tokenizer, q_ids, question, v)
                                           for v in wrong]
          rows.append((prompt, list(prompt.answers) + wrong, ids))
      cells[(length, depth)] = rows
  return cells


def run(lm, haystack, *, lengths, depths, needles_per_cell: int = 20, variant: str = "single",
        distractors: int = 9, batch_size: int = 8, seed: int = 0, source: str = "",
        key_words=None, log=print) -> dict:
  """Scores the grid on `lm` (an `efficient_lm.load` model) with haystack tokens `haystack` (one
  document: no end-of-document token); keys from `key_words` when given, else two random words.
  Returns the record needle.json holds. Progress (a line a length, and how far it is every 20 s)
  goes to stderr (`progress.phase`); `log` gets the reach warning."""
  _check(lengths, depths, needles_per_cell, variant, distractors, batch_size)
  eos = int(lm.tokenizer.eos_id)
  if len(haystack) == 0:
    raise needle_lib.NeedleError(f"the haystack ({source}) holds no text; give --haystack=FILE "
                                 "with some text")
  cells = build_grid(lm.tokenizer, haystack, lengths=lengths, depths=depths,
                     needles_per_cell=needles_per_cell, variant=variant, distractors=distractors,
                     seed=seed, key_words=key_words)
  width = max(len(a) for rows in cells.values() for _, _, ids in rows for a in ids)
  warning = reach.check(lm.config, lengths, extra=width + 1)
  if warning:
    log(warning)
  document_mask = bool(lm.config.data.document_mask)
  results = {key: [] for key in cells}
  seconds = {}
  total = sum(len(cell) for cell in cells.values())
  done = {"length": lengths[0], "prompts": 0}
  status = lambda: f"length {done['length']:,}: {done['prompts']:,} of {total:,} prompts scored"
  with progress.phase(f"needle grid ({variant}): {len(lengths)} length(s) x {len(depths)} "
                      f"depth(s)", status=status):
    for length in lengths:
      began, done["length"] = time.time(), length
      rows = [(key, row) for key, cell in cells.items() if key[0] == length for row in cell]
      # a fixed shape, one compile per length: the last batch filled with its first prompt again
      for batch, real in score_rows.batches(rows, batch_size, pad=rows[0]):
        prompts = [row[0] for _, row in batch]
        new_ids = generation.generate_batch(
            lm.model, [p.ids[1:] for p in prompts], num_tokens=width + 1, eos_id=eos,
            temperature=0.0, vocab_size=lm.tokenizer.vocab_size, document_mask=document_mask)
        scores = needle_lib.rank_scores(lm.model, prompts, [row[1] for _, row in batch],
                                        [row[2] for _, row in batch], width, eos_id=eos,
                                        document_mask=document_mask)
        for b in range(real):
          key, (prompt, _, _) = batch[b]
          text = lm.tokenizer.decode([t for t in new_ids[b] if t != eos])
          results[key].append({
              "exact": needle_lib.is_exact(text, prompt.answers),
              "digits": needle_lib.leading_digits(text, prompt.answers),
              "rank": needle_lib.rank_of(scores[b], len(prompt.answers)),
              "answer": text[:24], "expected": prompt.answers[0], "group": prompt.group,
              "needle_start": int(prompt.needle_starts[0]),
              "needle_end": int(prompt.needle_starts[0] + len(prompt.needle_ids[0]))})
        done["prompts"] += real
      seconds[length] = time.time() - began
      log_progress.info("needle grid: length %s done, %s prompts in %s (%s of %s)", f"{length:,}",
                        f"{len(rows):,}", progress.duration(seconds[length]),
                        f"{done['prompts']:,}", f"{total:,}")
  return _record(lm, results, lengths=lengths, depths=depths, needles_per_cell=needles_per_cell,
                 variant=variant, distractors=distractors, source=source, seconds=seconds,
                 warning=warning, keys="words" if key_words else "pairs")


def _cell_figures(rows: list[dict]) -> dict:
  exact = [r["exact"] for r in rows]
  ranks = np.asarray([r["rank"] for r in rows])
  figures = {"prompts": len(rows), "exact": report.wilson(int(sum(exact)), len(rows)),
             "top1": report.wilson(int(np.sum(ranks == 1)), len(rows)),
             "mrr": report.mean_interval(1.0 / ranks),
             "digits": report.mean_interval(np.asarray([r["digits"] for r in rows], np.float64))}
  groups = sorted({r["group"] for r in rows})
  if len(groups) < len(rows):  # multiquery: a haystack counts when every key's answer is exact
    every = [all(r["exact"] for r in rows if r["group"] == g) for g in groups]
    figures["exact_all_keys"] = report.wilson(int(sum(every)), len(groups))
  return figures


def _record(lm, results, *, lengths, depths, needles_per_cell, variant, distractors, source,
            seconds, warning, keys) -> dict:
  num_true = needle_lib.EXTRA_NEEDLES + 1 if variant == "multivalue" else 1
  cells = [{"length": length, "depth": depth, **_cell_figures(results[(length, depth)]),
            "answers": [{k: r[k] for k in ("answer", "expected", "exact", "digits", "rank",
                                           "needle_start", "needle_end")}
                        for r in results[(length, depth)]]}
           for length in lengths for depth in depths]
  every = [r for rows in results.values() for r in rows]
  return {"task": "needle", "variant": variant, "model": lm.config.model.name, "step": lm.step,
          "seq_len": lm.seq_len, "path": lm.path, "haystack": source, "lengths": list(lengths),
          "depths": list(depths), "needles_per_cell": needles_per_cell, "distractors": distractors,
          "keys": keys, "chance": report.chance(num_true, distractors), "all": _cell_figures(every),
          "cells": cells, "seconds_per_length": {str(k): round(v, 2) for k, v in seconds.items()},
          "warning": warning}


def write(record: dict, out: str) -> tuple[str, str]:
  """needle.json and needle.png (the heatmaps: depth down, length across, the score in colour
  and in numbers) into `out`; returns their paths."""
  json_path, png_path = os.path.join(out, "needle.json"), os.path.join(out, "needle.png")
  report.write_json(record, json_path)
  plt = report.pyplot()
  lengths, depths = record["lengths"], record["depths"]
  by = {(c["length"], c["depth"]): c for c in record["cells"]}
  panels = (("exact match (greedy)", lambda c: c["exact"]["share"], None),
            (f"mean reciprocal rank among {record['distractors']} distractors",
             lambda c: c["mrr"]["mean"], record["chance"]["mrr"]))
  fig, axes = plt.subplots(1, 2, figsize=(4 + 1.3 * len(lengths) * 2, 1.5 + 0.5 * len(depths)))
  for ax, (title, value, chance) in zip(axes, panels):
    grid = np.asarray([[value(by[(n, d)]) for n in lengths] for d in depths], np.float64)
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    for i in range(len(depths)):
      for j in range(len(lengths)):
        ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title + (f" (chance {chance:.2f})" if chance is not None else ""), fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.04)
  fig.suptitle(f"{record['model']} step {record['step']}: needle ({record['variant']}), "
               f"{record['needles_per_cell']} a cell, haystack {record['haystack']}", fontsize=10)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
  return json_path, png_path


def result(record: dict, json_path: str, png_path: str) -> dict:
  """The stdout line's figures: the settings and the figures over all cells (needle.json holds
  every cell and answer), the files' paths."""
  keys = ("task", "model", "step", "seq_len", "variant", "haystack", "lengths", "depths",
          "needles_per_cell", "distractors", "keys", "chance")
  return {**{k: record[k] for k in keys}, **record["all"], "warning": record["warning"],
          "json": os.path.abspath(json_path), "png": os.path.abspath(png_path)}


def summary(record: dict, json_path: str) -> str:
  a = record["all"]
  e, t, m = a["exact"], a["top1"], a["mrr"]
  return (f"needle ({record['variant']}) {record['model']} step {record['step']} over "
          f"{len(record['cells'])} cells ({a['prompts']} prompts, lengths "
          f"{','.join(map(str, record['lengths']))}): exact {e['share']:.3f} "
          f"[{e['ci_low']:.3f}, {e['ci_high']:.3f}], top-1 {t['share']:.3f} "
          f"[{t['ci_low']:.3f}, {t['ci_high']:.3f}] (chance {record['chance']['top1']:.3f}), MRR "
          f"{m['mean']:.3f} (chance {record['chance']['mrr']:.3f}), leading digits right "
          f"{a['digits']['mean']:.2f} of {needle_lib.DIGITS}; {json_path}")
