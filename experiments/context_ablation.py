"""What context beyond N tokens is worth on real text: the swap ablation, per model and seed.

    nice -n 19 python -m experiments.context_ablation --pause_file=/tmp/efficient_lm_quiet
    python -m experiments.context_ablation --corpora=shakespeare --models=bcmt,honly --seeds=0

Per (corpus, model, seed): a training run (`python -m efficient_lm.main` in a subprocess, the
corpus's shared settings `CORPORA[...]['settings']` and the model's `MODELS[...]`), then
`python -m efficient_lm.evaluate --split=validation --context=C --stride=S --ablate_context=N
--ablate_method=swap --max_tokens=M`: every scored token twice, with its window and with only
its last N - S .. N - 1 tokens of its own context, the inputs before them swapped for text of
another document of the split (an input the model has seen the like of: training windows run
across documents; not end-of-document tokens, which it never sees in runs). Each row: full loss,
ablated loss, their difference (delta, nats per token, positive = the model uses the context
beyond N) and a 95% bootstrap interval over documents (a description of that run; the claims
are decided over seeds by `experiments.verdicts`). Models whose receptive field (`EXACT_NULL`)
is below N - S give exactly 0 (the same computation in both passes). ECP (4 pieces) and
Perceiver-AR get the same cut, which lies inside their reach (ECP's two hops over pieces of C/4
reach 640-767 tokens back on the plays and 1,280-1,535 on code; Perceiver-AR's latents read the
whole window).

The placebo gate (`placebo`, registered in experiments/registered/swap_placebo_gate.json before the
runs it governs): every row carries its placebo bin, the tokens whose position in their document is
below the cut (their far context is another document's text in both passes: the swap removes
nothing there), and is validated only when that bin bounds the swap's disruption below the effect
tested. It replaced a cross-run check (ablated BCMT against HOnly's full loss) that compared a
between-run difference with a within-run tolerance.

Rows go to experiments/results/context_ablation.json after every run (model, corpus, seed,
method, full_loss, ablated_loss, delta, ci_low, ci_high, ...); resumable and additive (`--force`
reruns), and runs over disjoint rows may share the file (each save merges the rows on disk,
under the lock file `<results>.lock`). Rows of the earlier end-of-document readout are kept with
method "eos".
"""
import argparse
import fcntl
import json
import os
import signal
import sys

from experiments.common import REPO, write_json
from experiments.runner import run_monitored, tail

COMMON = {"model.d_model": 128, "model.num_layers": 2, "model.num_heads": 4,
          "train.learning_rate": 2e-3, "train.warmup_steps": 50, "train.log_every": 50,
          "train.eval_every": 100000, "train.checkpoint_every": 100000, "train.sample_tokens": 0,
          "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1, "mesh.context": 1}
CORPORA = {
    # The embedded corpus: context 1024, cut at 512 (stride 128: tokens keep 384..511).
    "shakespeare": {"settings": {"data.dataset": "shakespeare", "data.seq_len": 1024,
                                 "data.batch_size": 8, "train.num_steps": 500},
                    "context": 1024, "stride": 128, "ablate": 512, "max_tokens": 60000},
    # SQLAlchemy's sources: context 2048, cut at 1024 (tokens keep 768..1023); 200K tokens are 17
    # files (its files are long: 60K were 4, too few for the test over documents).
    "python_code": {"settings": {"data.dataset": "python_code", "data.seq_len": 2048,
                                 "data.batch_size": 4, "train.num_steps": 500,
                                 "train.sample_prompt": ""},
                    "context": 2048, "stride": 256, "ablate": 1024, "max_tokens": 200000},
}
MODELS = {
    "dense": ("configs/dense.py", {}),
    "sliding_window": ("configs/sliding_window.py", {"model.window": 128}),
    "pi_attention": ("configs/pi_attention.py", {"model.window": 128, "model.period": 256,
                                                 "model.num_skips": 3}),
    # π whose skips reach past the code corpus's cut (256 .. 1,792 back): the registered study
    # experiments/registered/pi_window_code.json (π against the window where far context matters).
    "pi_attention_far": ("configs/pi_attention.py", {"model.window": 128, "model.period": 256,
                                                     "model.num_skips": 7}),
    "bcmt": ("configs/bcmt.py", {"model.block_size": 256}),
    "honly": ("configs/bcmt.py:honly", {"model.block_size": 256}),
    "ecp": ("configs/ecp.py", {"model.num_segments": 4}),
    "perceiver_ar": ("configs/perceiver_ar.py", {"model.num_latents": 256}),  # >= every stride
}
# Receptive fields below every corpus's N - S (2 layers): exact nulls by construction.
EXACT_NULL = {"sliding_window": 2 * 127, "honly": 255}
SEEDS = (0, 1, 2)  # stats.PLANNED_SEEDS["loss"], chosen before the runs (issue 33)
METHOD = "swap"


def command(corpus: str, model: str, seed: int, workdir: str) -> list[str]:
  config, fields = MODELS[model]
  settings = {**COMMON, **CORPORA[corpus]["settings"], **fields, "train.seed": seed}
  return [sys.executable, "-m", "efficient_lm.main", f"--config={config}", f"--workdir={workdir}",
          *[f"--config.{k}={v}" for k, v in settings.items()]]


def run_row(corpus: str, model: str, seed: int, args) -> dict:
  c = CORPORA[corpus]
  key = f"{corpus}/{model}@{seed}"
  workdir = os.path.join(args.workdir_root, corpus, f"{model}@{seed}")
  os.makedirs(workdir, exist_ok=True)
  train = command(corpus, model, seed, workdir)
  print(f"{key}: training", flush=True)
  log = workdir + ".log"
  run = run_monitored(train, log, args.pause_file)
  if run["returncode"] != 0:
    raise RuntimeError(f"{key} training failed:\n{tail(log)}")
  score = [sys.executable, "-m", "efficient_lm.evaluate", f"--workdir={workdir}",
           "--split=validation", f"--context={c['context']}", f"--stride={c['stride']}",
           f"--ablate_context={c['ablate']}", f"--ablate_method={METHOD}",
           f"--max_tokens={c['max_tokens']}"]
  score_log = workdir + ".score.log"
  scored = run_monitored(score, score_log, args.pause_file)
  if scored["returncode"] != 0:
    raise RuntimeError(f"{key} scoring failed:\n{tail(score_log)}")
  with open(score_log) as f:
    result = json.loads(f.read().strip().splitlines()[-1])
  a = result["ablation"]
  from experiments.long_range import code_version  # pylint: disable=import-outside-toplevel
  return {"model": model, "corpus": corpus, "seed": seed, "method": a["method"],
          "swap_relaxed_windows": a.get("swap_relaxed_windows"), "windows": result["num_windows"],
          "ablate_context": c["ablate"], "kept_context": a["kept_context"],
          **{k: a["all"][k] for k in ("full_loss", "ablated_loss", "delta", "ci_low", "ci_high",
                                      "p_value", "tokens", "documents")},
          "by_position_in_document": a["by_position_in_document"],
          "exact_null": model in EXACT_NULL and EXACT_NULL[model] < c["ablate"] - c["stride"],
          "validation_loss": result["loss"], "train_seconds": run["seconds"],
          "cpu_seconds": run["cpu_seconds"] + scored["cpu_seconds"], "load_mean": run["load_mean"],
          "command": " ".join(train), "score_command": " ".join(score), "code": code_version()}


def placebo(row: dict, gate: dict) -> dict:
  """The row's placebo bin and the gate's mark (`gate`: experiments/registered/swap_placebo_gate.json).

  The bin is the tokens whose position in their document is below the cut: their context beyond
  the cut is another document's text in both passes, so the swap removes no same-document
  information there and its cost in the bin is disruption. Validated: the bin holds at least
  `min_documents` documents and `min_tokens` tokens, and its 95% upper bound (over documents) lies
  below the row's delta over the later tokens (the effect tested)."""
  cut = row["ablate_context"]
  early = [b for b in row["by_position_in_document"] if b["low"] == 0 and b["high"] == cut]
  if not early:
    raise ValueError(f"{row['corpus']}/{row['model']}@{row['seed']}: no position bin [0, {cut}) to "
                     "serve as the placebo")
  b = early[0]
  later_tokens = row["tokens"] - b["tokens"]
  later = (row["delta"] * row["tokens"] - b["delta"] * b["tokens"]) / later_tokens
  if b["documents"] < gate["min_documents"] or b["tokens"] < gate["min_tokens"]:
    why = (f"the placebo bin holds {b['documents']} documents and {b['tokens']} tokens (the gate "
           f"needs {gate['min_documents']} and {gate['min_tokens']})")
  elif b["ci_high"] >= later:
    why = (f"the swap's cost where it removes nothing is bounded only by {b['ci_high']:+.4f}, not "
           f"below the effect tested ({later:+.4f})")
  else:
    why = ""
  return {"tokens": b["tokens"], "documents": b["documents"], "delta": b["delta"],
          "upper": b["ci_high"], "later_delta": later, "later_tokens": later_tokens,
          "validated": not why, "why_not": why}


def load(path: str) -> tuple[dict, dict]:
  """The results file (empty if there is none) and its rows by (corpus, model, seed, method)."""
  results = {"rows": []}
  if os.path.isfile(path):
    with open(path) as f:
      results = json.load(f)
  for r in results["rows"]:
    r.setdefault("method", "eos")  # the rows before the swap control
  return results, {(r["corpus"], r["model"], r["seed"], r["method"]): r for r in results["rows"]}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--corpora", default=",".join(CORPORA))
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
  parser.add_argument("--force", action="store_true")
  parser.add_argument("--results", default=os.path.join(REPO, "experiments", "results",
                                                        "context_ablation.json"))
  parser.add_argument("--workdir_root", default=os.path.join(REPO, "runs", "context_ablation"))
  parser.add_argument("--pause_file", default="")
  args = parser.parse_args(argv)
  for name, given, known in (("corpora", args.corpora, CORPORA), ("models", args.models, MODELS)):
    unknown = sorted(set(given.split(",")) - set(known))
    if unknown:
      sys.exit(f"error: --{name}: unknown {unknown}; use {', '.join(known)}")
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the running row too (run_monitored)
  results, done = load(args.results)

  def save():
    # Under a lock, and merged with the rows on disk: runs over disjoint rows (say one per seed)
    # can share one results file; this run's rows win over the file's.
    with open(args.results + ".lock", "a") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      for key, row in load(args.results)[1].items():
        done.setdefault(key, row)
      results["rows"] = sorted(done.values(), key=lambda r: (r["method"] != METHOD, r["corpus"],
                                                             r["model"], r["seed"]))
      results.update(corpora=CORPORA, models={k: v[1] for k, v in MODELS.items()}, common=COMMON)
      results.pop("gates", None)
      results.pop("sanity_failures", None)  # the cross-run check the placebo gate replaced
      write_json(args.results, results)

  with open(os.path.join(REPO, "experiments", "registered", "swap_placebo_gate.json")) as f:
    gate = json.load(f)
  for seed in map(int, args.seeds.split(",")):
    for corpus in args.corpora.split(","):
      for model in args.models.split(","):
        key = (corpus, model, seed, METHOD)
        if key not in done or args.force:
          done[key] = run_row(corpus, model, seed, args)
          save()
        r = done[key]
        print(f"{corpus}/{model}@{seed}: loss {r['full_loss']:.4f} -> {r['ablated_loss']:.4f} with the "
              f"context beyond {r['ablate_context']} swapped: {r['delta']:+.4f} nats/token "
              f"[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}]", flush=True)
        if not r.get("exact_null") and r.get("by_position_in_document"):
          mark = placebo(r, gate)
          print(f"  placebo (position in document < {r['ablate_context']}): {mark['delta']:+.4f}, "
                f"upper {mark['upper']:+.4f} over {mark['tokens']} tokens against {mark['later_delta']:+.4f} "
                "later: " + ("validated" if mark["validated"] else f"not validated ({mark['why_not']})"),
                flush=True)
  save()


if __name__ == "__main__":
  main()
