"""Needles in text, every family: trained on `needle:`, scored by the needle-in-a-haystack grid.

    nice -n 19 python -m experiments.needle_study --pause_file=/tmp/efficient_lm_quiet
    python -m experiments.needle_study --models=dense,sliding_window --seeds=0
    nice -n 19 python -m experiments.needle_study --models=gated_deltanet \
        --results=experiments/results/needle_beside.json --figures=experiments/results/needle_beside \
        --workdir_root=runs/needle_beside --pause_file=/tmp/efficient_lm_quiet   # beside the study

Registered (experiments/registered/needle_reach.json: its claims, controls, tests and power) before
its runs, with the setting the pilot found (experiments/README.md, "Needles in text: the pilot"):
packed examples of 128 tokens and more (`min_length=128`), so that short haystacks teach the lookup
and long ones ask for reach, and a 1,024-piece tokenizer.

Per (model, seed): a training run (`python -m efficient_lm.main` in a subprocess: `SETTINGS`, the
model's `MODELS[...]`, `train.seed`) on the `needle:` source (`DATASET`: corpus text with a needle
planted, its question at the end, the loss on the answer's digits), then
`python -m efficient_lm.evaluate --task=needle` over `GRID` (the base corpus's test text as
haystack, the training source's key words, 20 needles a cell, the same prompts for every model:
`--seed=0`). Its needle.json and heatmap (needle.png) go to
experiments/results/needle_reach/<model>@<seed>/, and a row to
experiments/results/registered/needle_reach.json: exact match and top-1 over all prompts, over
the prompts whose needle lies past `REACH` tokens from the prompt's end (no token of it visible to
a 2-layer window of 128, the sliding window's receptive field: `far`) and within it (every token
of it visible: `near`), each cell's exact match and top-1, and the lowest of each. Resumable and additive: a finished row is
kept (`--force` reruns it); a training run resumes from its checkpoints.

Models that came after the registration (`BESIDE`: Gated DeltaNet) train and score the same way, as
exploratory rows beside the study: their rows go to `BESIDE_RESULTS` (the script refuses to write
them into the registered file) and decide nothing.
"""

import argparse
import json
import os
import signal
import sys

import numpy as np

from experiments.common import REPO, write_json
from experiments.runner import run_monitored, tail

DATASET = "needle:needles=1,distractors=0,min_length=128,eval_sequences=64"
SETTINGS = {"data.dataset": DATASET, "data.seq_len": 1024, "data.vocab_size": 1024,
            "data.batch_size": 8, "model.d_model": 128, "model.num_layers": 2, "model.num_heads": 4,
            "train.num_steps": 1500, "train.learning_rate": 3e-3, "train.warmup_steps": 50,
            "train.weight_decay": 0.0,
            "train.log_every": 50, "train.eval_every": 500, "train.checkpoint_every": 250,
            "train.sample_prompt": "", "train.sample_tokens": 0,
            "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1, "mesh.context": 1}
MODELS = {
    "dense": ("configs/dense.py", {}),
    "sliding_window": ("configs/sliding_window.py", {"model.window": 128}),
    # Skips 128 .. 896 back: one hop reaches every needle of a 1,024-token prompt.
    "pi_attention": ("configs/pi_attention.py", {"model.window": 128, "model.period": 128,
                                                 "model.num_skips": 7}),
    "bcmt": ("configs/bcmt.py", {"model.block_size": 128}),
    "honly": ("configs/bcmt.py:honly", {"model.block_size": 128}),
    # Pieces of 128: two hops over overlapping pairs reach 256-383 tokens back.
    "ecp": ("configs/ecp.py", {"model.num_segments": 8}),
    # Latents: the last 128 positions (the questions and answers sit there), reading every input.
    "perceiver_ar": ("configs/perceiver_ar.py", {"model.num_latents": 128}),
}
# Exploratory models beside the study: not among its registered arms, so their rows go to a results
# file of their own (`BESIDE_RESULTS`, never the registered one) and decide nothing. Their own
# config's fields at the study's shared settings.
BESIDE = {
    "gated_deltanet": ("configs/gated_deltanet.py", {}),
}
ARMS = {**MODELS, **BESIDE}  # every model the script trains
GRID = {"lengths": "256,512,768,1024", "depths": "0,0.25,0.5,0.75,1", "needles_per_cell": 20,
        "variant": "single", "distractors": 9, "seed": 0}
REACH = 254  # the sliding window's receptive field: 2 layers x (window 128 - 1)
SEEDS = (0, 1, 2)
RESULTS = os.path.join(REPO, "experiments", "results", "registered", "needle_reach.json")
FIGURES = os.path.join(REPO, "experiments", "results", "needle_reach")
BESIDE_RESULTS = os.path.join(REPO, "experiments", "results", "needle_beside.json")
BESIDE_FIGURES = os.path.join(REPO, "experiments", "results", "needle_beside")
README = os.path.join(REPO, "experiments", "README.md")


def train_command(model: str, seed: int, workdir: str) -> list[str]:
  config, fields = ARMS[model]
  settings = {**SETTINGS, **fields, "train.seed": seed}
  return [sys.executable, "-m", "efficient_lm.main", f"--config={config}", f"--workdir={workdir}",
          *[f"--config.{k}={v}" for k, v in settings.items()]]


def eval_command(workdir: str, out: str) -> list[str]:
  return [sys.executable, "-m", "efficient_lm.evaluate", f"--workdir={workdir}", "--task=needle",
          "--keys=words", *[f"--{k}={v}" for k, v in GRID.items()], f"--out={out}"]


def by_reach(record: dict, reach: int = REACH) -> dict:
  """Exact match and top-1 over every prompt of a needle.json `record`, over the prompts whose
  needle lies wholly past `reach` tokens before the prompt's last token (`far`: the needle ends at
  or before index length - reach), and wholly within it (`near`: it starts at or after that)."""
  groups = {"all": [], "far": [], "near": []}
  for cell in record["cells"]:
    edge = cell["length"] - reach
    for a in cell["answers"]:
      groups["all"].append(a)
      if a["needle_end"] <= edge:
        groups["far"].append(a)
      elif a["needle_start"] >= edge:
        groups["near"].append(a)
  out = {}
  for name, rows in groups.items():
    n = len(rows)
    out[f"prompts_{name}"] = n
    out[f"exact_{name}"] = sum(a["exact"] for a in rows) / n if n else None
    out[f"top1_{name}"] = sum(a["rank"] == 1 for a in rows) / n if n else None
  out["min_cell_exact"] = min(c["exact"]["share"] for c in record["cells"])
  out["min_cell_top1"] = min(c["top1"]["share"] for c in record["cells"])
  return out


def run_row(model: str, seed: int, args) -> dict:
  key = f"{model}@{seed}"
  workdir = os.path.join(args.workdir_root, key)
  os.makedirs(workdir, exist_ok=True)
  train = train_command(model, seed, workdir)
  print(f"{key}: training", flush=True)
  run = run_monitored(train, workdir + ".log", args.pause_file)
  if run["returncode"] != 0:
    raise RuntimeError(f"{key} training failed:\n{tail(workdir + '.log')}")
  out = os.path.join(args.figures, key)
  score = eval_command(workdir, out)
  print(f"{key}: needle grid", flush=True)
  scored = run_monitored(score, workdir + ".needle.log", args.pause_file)
  if scored["returncode"] != 0:
    raise RuntimeError(f"{key} needle grid failed:\n{tail(workdir + '.needle.log')}")
  with open(os.path.join(out, "needle.json")) as f:
    record = json.load(f)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    final = [m for m in map(json.loads, f) if "eval_loss" in m][-1]
  from experiments.long_range import code_version  # pylint: disable=import-outside-toplevel
  return {"model": model, "seed": seed, **by_reach(record), "chance_top1": record["chance"]["top1"],
          "cells": [{"length": c["length"], "depth": c["depth"], "exact": c["exact"]["share"],
                     "top1": c["top1"]["share"]} for c in record["cells"]],
          "answer_loss": final["eval_loss"], "step": record["step"],
          "figures": os.path.relpath(out, REPO), "train_seconds": run["seconds"],
          "cpu_seconds": run["cpu_seconds"] + scored["cpu_seconds"], "load_mean": run["load_mean"],
          "command": " ".join(train), "eval_command": " ".join(score), "code": code_version()}


def answer_digits(row: dict) -> dict | None:
  """A row's greedy answers read digit by digit, from its committed needle.json (None without it):
  `leading`, the mean count of right digits before the first wrong one
  (`long_context.needle.leading_digits`); `any_order`, the mean count of the value's digits the answer
  holds in any order (`digits_in_any_order`); and `any_order_chance`, the same answers scored
  against the other prompts' values (a null that keeps each model's own digit habits: an answer
  of one digit repeated scores below uniform digits)."""
  from efficient_lm.evaluation.long_context import needle  # pylint: disable=import-outside-toplevel
  path = os.path.join(REPO, row["figures"], "needle.json")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    answers = [a for c in json.load(f)["cells"] for a in c["answers"]]
  n = len(answers)
  mean = lambda f: sum(map(f, answers)) / n
  # digits_in_any_order for every (answer, value) pair at once: the multiset overlap is the sum
  # over digits of the smaller count; the answer's counts are of its first 7 digits.
  counts = lambda texts: np.array([[t.count(str(d)) for d in range(10)] for t in texts])
  first = [needle.digit_run(a["answer"])[:len(a["expected"])] for a in answers]
  overlap = np.minimum(counts(first)[:, None], counts([a["expected"] for a in answers])[None]).sum(-1)
  return {"leading": mean(lambda a: needle.leading_digits(a["answer"], [a["expected"]])),
          "any_order": float(np.trace(overlap)) / n,  # each answer against its own value
          "any_order_chance": ((overlap.sum() - np.trace(overlap)) / (n * (n - 1)) if n > 1
                               else None)}


def render(results: dict) -> str:
  """experiments/README.md's `needle_reach` block: one line per finished row."""
  rows = results.get("rows", [])
  if not rows:
    return "No row has finished yet."
  fmt = lambda x: "-" if x is None else f"{x:.3f}"
  fmt2 = lambda x: "-" if x is None else f"{x:.2f}"
  lines = ["| model@seed | top-1 all / far / near | lowest cell top-1 | exact all | leading digits "
           "right (of 7) | digits in any order (others' values) | answer loss | heatmap |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    digits = answer_digits(r)
    figure = os.path.relpath(os.path.join(REPO, r["figures"], "needle.png"), os.path.dirname(README))
    read = ("- | -" if digits is None else
            f"{digits['leading']:.2f} | {digits['any_order']:.2f} ({fmt2(digits['any_order_chance'])})")
    lines.append(
        f"| {r['model']}@{r['seed']} | {fmt(r['top1_all'])} / {fmt(r['top1_far'])} / "
        f"{fmt(r['top1_near'])} | {fmt(r['min_cell_top1'])} | {fmt(r['exact_all'])} | "
        f"{read} | {r['answer_loss']:.4f} | [needle.png]({figure}) |")
  return "\n".join(lines)


def load(path: str) -> dict:
  if os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  return {"rows": []}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
  parser.add_argument("--force", action="store_true")
  parser.add_argument("--results", default=RESULTS)
  parser.add_argument("--figures", default=FIGURES)
  parser.add_argument("--workdir_root", default=os.path.join(REPO, "runs", "registered", "needle_reach"))
  parser.add_argument("--pause_file", default="")
  args = parser.parse_args(argv)
  models = args.models.split(",")
  unknown = sorted(set(models) - set(ARMS))
  if unknown:
    sys.exit(f"error: --models: unknown {unknown}; use {', '.join(MODELS)} (the study's) or "
             f"{', '.join(BESIDE)} (exploratory, beside it)")
  beside = sorted(set(models) & set(BESIDE))
  if beside and os.path.abspath(args.results) == os.path.abspath(RESULTS):
    sys.exit(f"error: --models: {beside} are not among the registered study's arms; their rows go "
             f"beside it: --results={os.path.relpath(BESIDE_RESULTS, REPO)} "
             f"--figures={os.path.relpath(BESIDE_FIGURES, REPO)} --workdir_root=runs/needle_beside")
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the running row too
  results = load(args.results)
  done = {(r["model"], r["seed"]): r for r in results["rows"]}
  for seed in map(int, args.seeds.split(",")):
    for model in models:
      if (model, seed) not in done or args.force:
        done[(model, seed)] = run_row(model, seed, args)
        results.update(rows=sorted(done.values(), key=lambda r: (r["model"], r["seed"])),
                       settings=SETTINGS,
                       models={**results.get("models", {}), **{m: ARMS[m][1] for m in models}},
                       grid=GRID, reach=REACH)
        write_json(args.results, results)
      r = done[(model, seed)]
      print(f"{model}@{seed}: exact {r['exact_all']:.3f} (far {r['exact_far']}, near "
            f"{r['exact_near']}), top-1 {r['top1_all']:.3f}, answer loss {r['answer_loss']:.4f}",
            flush=True)


if __name__ == "__main__":
  main()
