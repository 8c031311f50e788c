"""Exploratory: the needle study's trained rows asked RULER's other variants.

The registered needle study (`needle_study.py`) trains every family on `needle:` with one needle
and no distractor needles, and scores the single variant. A model so trained can answer by copying
the one value in its haystack without reading the key. `multikey` plants 3 needles of other keys
beside the asked one, and its rank puts their values first among the distractors: top-1 near 1
says the model reads the key, about 1/4 that it copies one of the values. Not registered: these
rows are reported, never a verdict.

    nice -n 19 python -m experiments.needle_variants --pause_file=/tmp/efficient_lm_quiet

Each row scores a study workdir (`--workdir_root`, the study's) whose row the study's results hold
(a finished training) on the study's grid with `--variant`; a row is kept once written (`--force`
reruns it).
"""

import argparse
import json
import os
import sys

from efficient_lm.evaluation.long_context import needle as needle_lib
from experiments import needle_study
from experiments.common import REPO, write_json
from experiments.runner import run_monitored, tail

VARIANTS = ("multikey",)  # run by default
OTHER_VARIANTS = tuple(v for v in needle_lib.VARIANTS if v != "single")  # what --variants accepts
RESULTS = os.path.join(REPO, "experiments", "results", "needle_variants.json")
FIGURES = os.path.join(REPO, "experiments", "results", "needle_variants")


def eval_command(workdir: str, out: str, variant: str) -> list[str]:
  """The study's evaluation of `workdir`, with `variant` for its single needle."""
  return [f"--variant={variant}" if a == "--variant=single" else a
          for a in needle_study.eval_command(workdir, out)]


def run_row(model: str, seed: int, variant: str, args) -> dict:
  key = f"{model}@{seed}"
  workdir = os.path.join(args.workdir_root, key)
  out = os.path.join(args.figures, key, variant)
  command = eval_command(workdir, out, variant)
  print(f"{key}: {variant}", flush=True)
  log = os.path.join(args.workdir_root, f"{key}.{variant}.log")
  scored = run_monitored(command, log, args.pause_file)
  if scored["returncode"] != 0:
    raise RuntimeError(f"{key} {variant} failed:\n{tail(log)}")
  with open(os.path.join(out, "needle.json")) as f:
    record = json.load(f)
  from experiments.long_range import code_version  # pylint: disable=import-outside-toplevel
  return {"model": model, "seed": seed, "variant": variant, **needle_study.by_reach(record),
          "chance_top1": record["chance"]["top1"], "step": record["step"],
          "figures": os.path.relpath(out, REPO), "cpu_seconds": scored["cpu_seconds"],
          "command": " ".join(command), "code": code_version()}


def _fmt(x) -> str:
  return "-" if x is None else f"{x:.3f}"


def render(results: dict, study: dict) -> str:
  """experiments/README.md's `needle_variants` block: each row beside the study's single-needle
  top-1 for the same model and seed."""
  rows = results.get("rows", [])
  if not rows:
    return "No row has run yet."
  single = {(r["model"], r["seed"]): r for r in study.get("rows", [])}
  fmt = _fmt
  lines = ["| model@seed | variant | top-1 all / far / near | single needle: top-1 all / far / near | "
           "exact all | heatmap |", "| --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    s = single.get((r["model"], r["seed"]))
    figure = os.path.relpath(os.path.join(REPO, r["figures"], "needle.png"),
                             os.path.dirname(needle_study.README))
    base = "-" if s is None else f"{fmt(s['top1_all'])} / {fmt(s['top1_far'])} / {fmt(s['top1_near'])}"
    lines.append(f"| {r['model']}@{r['seed']} | {r['variant']} | {fmt(r['top1_all'])} / "
                 f"{fmt(r['top1_far'])} / {fmt(r['top1_near'])} | {base} | {fmt(r['exact_all'])} | "
                 f"[needle.png]({figure}) |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", default=",".join(needle_study.MODELS))
  parser.add_argument("--seeds", default="0")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--force", action="store_true")
  parser.add_argument("--results", default=RESULTS)
  parser.add_argument("--figures", default=FIGURES)
  parser.add_argument("--workdir_root", default=os.path.join(REPO, "runs", "registered", "needle_reach"))
  parser.add_argument("--study_results", default=needle_study.RESULTS,
                      help="the study's results: only its finished rows are scored")
  parser.add_argument("--pause_file", default="")
  args = parser.parse_args(argv)
  for name, given, known in (("models", args.models, needle_study.MODELS),
                             ("variants", args.variants, OTHER_VARIANTS)):
    unknown = sorted(set(given.split(",")) - set(known))
    if unknown:
      sys.exit(f"error: --{name}: unknown {unknown}; use {', '.join(known)}")
  results = needle_study.load(args.results)
  done = {(r["model"], r["seed"], r["variant"]): r for r in results["rows"]}
  finished = {(r["model"], r["seed"]) for r in needle_study.load(args.study_results)["rows"]}
  for seed in map(int, args.seeds.split(",")):
    for model in args.models.split(","):
      if (model, seed) not in finished:
        print(f"{model}@{seed}: not a finished row of {args.study_results}; skipped", flush=True)
        continue
      for variant in args.variants.split(","):
        key = (model, seed, variant)
        if key not in done or args.force:
          done[key] = run_row(model, seed, variant, args)
          results["rows"] = sorted(done.values(), key=lambda r: (r["model"], r["seed"], r["variant"]))
          write_json(args.results, results)
        r = done[key]
        print(f"{model}@{seed} {variant}: top-1 {r['top1_all']:.3f} (far {_fmt(r['top1_far'])}, near "
              f"{_fmt(r['top1_near'])}), exact {r['exact_all']:.3f}", flush=True)


if __name__ == "__main__":
  main()
