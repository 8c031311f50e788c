"""Does any model use long context? Recall at controlled distances (MQAR), every family, paired seeds.

    nice -n 19 python -m experiments.long_range --pause_file=/tmp/efficient_lm_quiet   # every row
    python -m experiments.long_range --rows=dense@0 --steps=100                        # one row
    python -m experiments.long_range --render                                          # tables only

The task (`TASK`, `data.dataset='mqar:...'`): windows of 192 tokens, key-value pairs in the first
128, queries in the last 64 (so Perceiver-AR, which predicts only its latents, is trained and
scored on the same answers), each query's distance to its pair log-uniform over [21, 128], one
token per pair (`pair_tokens=1`: one attention hop answers a query; docs/data.md, MQAR). Every
row (model, seed) is a real training run, `python -m efficient_lm.main` in a subprocess with the
shared settings (`SETTINGS`: width, depth, batch, steps, learning rate) and the family's own
(`MODELS`: window, period, blocks, pieces, latents; which queries each model's attention reaches
in one hop follows from its patterns: `in_reach`), then
`python -m efficient_lm.evaluate --split=test --per_query_out=...`: accuracy per distance bin
and every answer of the test split (the same 8,192 queries for every model and seed: 1,024
sequences x 8). `dense_two_token` is dense on the same layouts with two-token pairs (`k v`,
Zoology's form): what the one-token form saves.

Rows go to experiments/results/long_range.json (one per model, seed and distance bin: model, seed,
bin_low, bin_high, accuracy, stderr, queries) after every run, every answer of a run to
experiments/results/long_range_queries/<model>@<seed>.npz (sequence, position, distance,
correct: what the verdicts test); a row already there is kept (resumable, additive; `--force`
retrains). The claims are decided by `experiments.verdicts`.
`--pause_file`: while that file exists the running subprocess is stopped (speed measurements).
"""

import argparse
import json
import math
import os
import signal
import sys

import numpy as np

from efficient_lm import models
from efficient_lm.data import mqar
from experiments.common import REPO, build, load_config, write_json
from experiments.runner import run_monitored, tail

TWO_TOKEN_TASK = ("mqar:seq_len=192,latents=64,queries=8,pairs=12,min_distance=21,"
                  "max_distance=128,keys=16,values=16,filler=16,eval_sequences=1024")
TASK = TWO_TOKEN_TASK + ",pair_tokens=1"
SETTINGS = {"data.seq_len": 192, "data.batch_size": 32, "data.vocab_size": 307,
            "model.d_model": 128, "model.num_layers": 2, "model.num_heads": 4,
            "model.mlp_ratio": 2, "train.learning_rate": 3e-3, "train.warmup_steps": 100,
            "train.weight_decay": 0.0, "train.log_every": 100, "train.eval_every": 100000,
            "train.checkpoint_every": 100000, "train.sample_prompt": "", "train.sample_tokens": 0,
            "train.schedule": "cosine", "train.eval_split": "validation",
            "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1, "mesh.context": 1}
W, P, S, L, Z = 32, 32, 3, 64, 64   # window, period, skips, block / piece, latents
MODELS = {
    "dense": ("configs/dense.py", {}),
    "sliding_window": ("configs/sliding_window.py", {"model.window": W}),
    "pi_attention": ("configs/pi_attention.py", {"model.window": W, "model.period": P,
                                                 "model.num_skips": S}),
    "bcmt": ("configs/bcmt.py", {"model.block_size": L}),
    "honly": ("configs/bcmt.py:honly", {"model.block_size": L}),
    "ecp": ("configs/ecp.py", {"model.num_segments": 192 // (L // 2)}),   # pieces of 32
    "perceiver_ar": ("configs/perceiver_ar.py", {"model.num_latents": Z}),
    "dense_two_token": ("configs/dense.py", {"data.dataset": TWO_TOKEN_TASK, "data.vocab_size": 51}),
    # ECP and Perceiver-AR at a depth where every judged query has an attention path (ECP's 4
    # hops over pieces of 32 reach every pair at d <= 128; 2 layers leave 68% of d > 64 unreached).
    "ecp_4layers": ("configs/ecp.py", {"model.num_segments": 192 // (L // 2), "model.num_layers": 4}),
    "perceiver_ar_4layers": ("configs/perceiver_ar.py", {"model.num_latents": Z, "model.num_layers": 4}),
    # π seed 1 (two-hop composition learnt late at 1,000 steps) trained to 3,000 steps: optimisation?
    "pi_attention_3000steps": ("configs/pi_attention.py", {"model.window": W, "model.period": P,
                                                           "model.num_skips": S,
                                                           "train.num_steps": 3000}),
    # Beside the families (exploratory rows): Gated DeltaNet's recurrence, its config's own fields.
    "gated_deltanet": ("configs/gated_deltanet.py", {}),
}
FAMILIES = ("dense", "sliding_window", "pi_attention", "bcmt", "honly", "ecp", "perceiver_ar")
SEEDS = (0, 1, 2, 3, 4)  # stats.PLANNED_SEEDS["recall"], chosen before the runs (issue 33)
# Run order: the first two seeds (the earlier runs), the 4-layer ECP / Perceiver-AR seeds, the
# new seeds of every family, then the diagnostics.
ROWS = ([(m, s) for s in SEEDS[:2] for m in FAMILIES] + [("dense_two_token", 0)]
        + [(m, s) for s in SEEDS for m in ("ecp_4layers", "perceiver_ar_4layers")]
        + [(m, s) for s in SEEDS[2:] for m in FAMILIES] + [("pi_attention_3000steps", 1)])
STEPS = 1000


def model_config(model: str):
  """The model section a row (variant: a key of MODELS) trains (its config file, the shared
  settings, its own fields)."""
  path, fields = MODELS[model]
  config = load_config(path)
  for key, value in {**SETTINGS, **fields}.items():
    section, field = key.split(".")
    if section in ("model", "data"):
      config[section][field] = value
  return build(config).model


# A path from every earlier token through a carried state (BCMT's memory of the earlier blocks, Gated
# DeltaNet's recurrence): never a null.
MEMORY_MODELS = ("bcmt", "gated_deltanet")


def family(model: str) -> str:
  """The model family (`model.name`) of a MODELS key: 'ecp_4layers' -> 'ecp'."""
  return model_config(model).name


def num_layers(model: str) -> int:
  return int(model_config(model).num_layers)


def row_steps(model: str, steps: int) -> int:
  """The steps a row trains: its own `train.num_steps` if it sets one, else `steps`."""
  return int(MODELS[model][1].get("train.num_steps", steps))


def multi_hop_reach(model: str, positions: np.ndarray, distances: np.ndarray) -> np.ndarray:
  """Whether any path of at most num_layers attention hops (each hop: a key some layer's pattern
  shows, or the position itself) leads from the pair's token to the answer. False: an exact null,
  no weights can recall that query. Analysis only: a [seq_len, seq_len] visibility matrix."""
  cfg = model_config(model)
  if cfg.name in MEMORY_MODELS:
    return np.ones(np.shape(positions), bool)
  T = cfg.seq_len
  i = np.arange(T)
  sees = np.eye(T, dtype=bool)
  for pattern in models.attention_patterns(cfg):
    sees |= np.asarray(pattern.visible(i[:, None], i[None, :]))
  reach = np.eye(T, dtype=bool)  # reach[a, p]: a's token has arrived at position p
  for _ in range(cfg.num_layers):
    reach = (reach.astype(np.int32) @ sees.T.astype(np.int32)) > 0
  positions = np.asarray(positions)
  return reach[positions - np.asarray(distances) + 1, positions]


def in_reach(model: str, positions: np.ndarray, distances: np.ndarray) -> np.ndarray:
  """Which queries (answer input position q, distance d) the model's attention reaches in one hop:
  some layer's pattern shows the query the pair's token (input position q - d + 1). BCMT's memory
  is not an attention pattern: only its blocks count."""
  cfg = model_config(model)
  seen = np.zeros(np.shape(positions), bool)
  for pattern in models.attention_patterns(cfg):
    seen |= np.asarray(pattern.visible(positions, positions - distances + 1))
  return seen


def row_key(model: str, seed: int) -> str:
  return f"{model}@{seed}"


def command(model: str, seed: int, workdir: str, steps: int) -> list[str]:
  config, fields = MODELS[model]
  settings = {**SETTINGS, "data.dataset": TASK, **fields, "train.seed": seed,
              "train.num_steps": row_steps(model, steps)}
  return [sys.executable, "-m", "efficient_lm.main", f"--config={config}", f"--workdir={workdir}",
          *[f"--config.{k}={v}" for k, v in settings.items()]]


def run_row(model: str, seed: int, args) -> dict:
  workdir = os.path.join(args.workdir_root, row_key(model, seed))
  os.makedirs(workdir, exist_ok=True)
  train = command(model, seed, workdir, args.steps)
  steps = row_steps(model, args.steps)
  print(f"{row_key(model, seed)}: training ({steps} steps)", flush=True)
  run = run_monitored(train, os.path.join(workdir, "..", f"{row_key(model, seed)}.log"),
                      args.pause_file)
  if run["returncode"] != 0:
    raise RuntimeError(f"{row_key(model, seed)} training failed:\n"
                       f"{tail(os.path.join(workdir, '..', row_key(model, seed) + '.log'))}")
  queries = os.path.join(os.path.dirname(args.results), "long_range_queries",
                         f"{row_key(model, seed)}.npz")
  os.makedirs(os.path.dirname(queries), exist_ok=True)
  score = [sys.executable, "-m", "efficient_lm.evaluate", f"--workdir={workdir}", "--split=test",
           f"--per_query_out={queries}"]
  score_log = os.path.join(workdir, "..", f"{row_key(model, seed)}.score.log")
  scored = run_monitored(score, score_log, args.pause_file)
  if scored["returncode"] != 0:
    raise RuntimeError(f"{row_key(model, seed)} scoring failed:\n{tail(score_log)}")
  with open(score_log) as f:
    result = json.loads(f.read().strip().splitlines()[-1])
  return {"model": model, "seed": seed, "steps": steps, "train_seconds": run["seconds"],
          "cpu_seconds": run["cpu_seconds"], "load_mean": run["load_mean"],
          "test_loss": result["loss"], "recall": result["recall"],
          "queries_file": os.path.relpath(queries, REPO), "command": " ".join(train),
          "code": code_version()}


def path_by_bin(run: dict) -> dict:
  """Per distance bin: the test queries some path of the model's attention reaches
  (`multi_hop_reach`) and its recall on them (None where there are none). Kept in the run."""
  if "path" not in run:
    q = load_queries(run)
    path = multi_hop_reach(run["model"], q["position"], q["distance"])
    edges = run["recall"]["edges"]
    queries, accuracy = [], []
    for lo, hi in zip(edges, edges[1:]):
      inside = path & (q["distance"] >= lo) & (q["distance"] < hi)
      queries.append(int(inside.sum()))
      accuracy.append(float(q["correct"][inside].mean()) if inside.any() else None)
    run["path"] = {"queries": queries, "accuracy": accuracy}
  return run["path"]


def rows_of(run: dict) -> list[dict]:
  """The result file's rows: one per distance bin. `model` is the family, `variant` the MODELS
  key; `path_queries` / `path_accuracy`: the bin's queries with an attention path, recall on them."""
  recall, path = run["recall"], path_by_bin(run)
  return [{"model": family(run["model"]), "variant": run["model"], "seed": run["seed"],
           "num_layers": num_layers(run["model"]), "steps": run["steps"], "bin_low": int(lo),
           "bin_high": int(hi), "accuracy": a, "stderr": e, "queries": n, "path_queries": pn,
           "path_accuracy": pa}
          for lo, hi, a, e, n, pn, pa in zip(recall["edges"], recall["edges"][1:], recall["accuracy"],
                                             recall["stderr"], recall["count"], path["queries"],
                                             path["accuracy"])]


def load_queries(run: dict) -> dict:
  """Every answer of a run's test split: sequence, position, distance, correct."""
  with np.load(os.path.join(REPO, run["queries_file"])) as f:
    return {k: f[k] for k in f.files}


def code_version() -> str:
  from experiments.paper_tables.rows import code_version as version  # pylint: disable=import-outside-toplevel
  return version()


def load(path: str) -> dict:
  if os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  return {"task": TASK, "settings": SETTINGS, "runs": {}, "rows": []}


def save(results: dict, path: str) -> None:
  results["models"] = {k: v[1] for k, v in MODELS.items()}
  results["rows"] = [row for run in results["runs"].values() for row in rows_of(run)]
  write_json(path, results)


def null_accuracy(run: dict, chance: float) -> str:
  """'accuracy (z, n)' over the queries no path reaches (`multi_hop_reach`); z = (accuracy -
  chance) / its binomial standard error at chance. '-' when the model reaches every query."""
  path = os.path.join(REPO, run.get("queries_file", ""))
  if "queries_file" not in run or not os.path.isfile(path):
    return "?"
  q = load_queries(run)
  null = ~multi_hop_reach(run["model"], q["position"], q["distance"])
  if not null.any():
    return "-"
  n, accuracy = int(null.sum()), float(q["correct"][null].mean())
  z = (accuracy - chance) / math.sqrt(chance * (1 - chance) / n)
  return f"{accuracy:.3f} (z {z:+.1f}, n {n:,})"


def render(results: dict) -> str:
  """The recall table: one row per model, accuracy per distance bin (each seed's, '/'-joined),
  the bins' integer distances as headers, and the accuracy where no path reaches the pair
  (`null_accuracy`: at chance, 1 / values, if the model is what its patterns say)."""
  runs = sorted(results["runs"].values(), key=lambda r: (list(MODELS).index(r["model"]), r["seed"]))
  if not runs:
    return "(no runs yet)"
  chance = 1.0 / mqar.parse(TASK).values
  edges = runs[0]["recall"]["edges"]
  bins = [f"{math.ceil(lo)}-{math.ceil(hi) - 1}" for lo, hi in zip(edges, edges[1:])]
  by_model: dict[str, list[dict]] = {}
  for run in runs:
    by_model.setdefault(run["model"], []).append(run)
  lines = ["| model | layers | steps | seeds | " + " | ".join(f"d {b}" for b in bins)
           + " | all | no path |", "| --- | --- | --- | --- |" + " --- |" * (len(bins) + 2)]
  for model, model_runs in by_model.items():
    cells = [" / ".join(f"{r['recall']['accuracy'][i]:.2f}" for r in model_runs)
             for i in range(len(bins))]
    overall = " / ".join(f"{r['recall']['accuracy_all']:.3f}" for r in model_runs)
    seeds = ",".join(str(r["seed"]) for r in model_runs)
    nulls = " / ".join(null_accuracy(r, chance) for r in model_runs)
    steps = ",".join(sorted({str(r["steps"]) for r in model_runs}))
    lines.append(f"| `{model}` | {num_layers(model)} | {steps} | {seeds} | " + " | ".join(cells)
                 + f" | {overall} | {nulls} |")
  counts = runs[0]["recall"]["count"]
  lines.append("")
  lines.append("Queries per bin (every row): " + ", ".join(f"{b}: {n:,}" for b, n in zip(bins, counts))
               + "; standard error at most sqrt(0.25 / n) (0.5 accuracy).")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", default="", help="model@seed,... (default: ROWS, in its order)")
  parser.add_argument("--steps", type=int, default=STEPS)
  parser.add_argument("--force", action="store_true")
  parser.add_argument("--results", default=os.path.join(REPO, "experiments", "results",
                                                        "long_range.json"))
  parser.add_argument("--workdir_root", default=os.path.join(REPO, "runs", "long_range"))
  parser.add_argument("--pause_file", default="")
  parser.add_argument("--render", action="store_true", help="only print the table of the results")
  args = parser.parse_args(argv)
  if args.render:
    print(render(load(args.results)))
    return
  keys = ([tuple(k.split("@")) for k in args.rows.split(",")] if args.rows else
          [(m, str(s)) for m, s in ROWS])
  unknown = sorted({m for m, _ in keys} - set(MODELS))
  if unknown:
    sys.exit(f"error: --rows: unknown models {unknown}; use keys of long_range.MODELS: "
             f"{', '.join(MODELS)}")
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the running row too (run_monitored)
  results = load(args.results)
  for model, seed in keys:
    key = row_key(model, int(seed))
    if key in results["runs"] and not args.force:
      print(f"{key}: kept", flush=True)
      continue
    results["runs"][key] = run_row(model, int(seed), args)
    save(results, args.results)
    recall = results["runs"][key]["recall"]
    print(f"{key}: recall {recall['accuracy_all']:.3f}; by bin "
          + " ".join("-" if a is None else f"{a:.2f}" for a in recall["accuracy"]), flush=True)
  save(results, args.results)


if __name__ == "__main__":
  main()
