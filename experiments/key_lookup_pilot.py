"""The key-lookup pilot: can dense learn to look a needle up by its key at this CPU's scale?

    nice -n 19 python -m experiments.key_lookup_pilot --pause_file=/tmp/efficient_lm_quiet
    python -m experiments.key_lookup_pilot --rows=k1          # one row

The needle study trained on one needle a haystack, so its models could answer by copying the one
value there without reading the key (with other keys' needles beside it, RULER's multikey, top-1
fell to 0.085-0.285). These rows train dense on `needle:` with 3 distractor needles (other keys,
other values, in the same haystack) and the end-of-answer target (`loss=answer_end`), so that
the value to give is the one its key names and exact match is possible; then score it on the
needle grid with `--variant=multikey` (3 needles of other keys beside the asked one, their values
ranked first among the distractors: copying one of the 4 values without reading the key ranks
the true one first about 1 time in 4) and with `--variant=single`.

The gate a key-lookup study needs before it is registered (issue 62): dense reads the key,
multikey top-1 >= 0.5 over the grid at the study's length. Seeds 100 and up: outside every
study's seeds. Not registered: pilot rows are reported, never a verdict. Each row is a real
training run (`python -m efficient_lm.main` in a subprocess, pausable with `--pause_file`), kept
once finished in experiments/results/key_lookup_pilot.json (resumable, additive; `--force`
reruns), figures under experiments/results/key_lookup_pilot/<row>/<variant>/.
"""

import argparse
import json
import os
import signal
import sys

from experiments import needle_study
from experiments.common import REPO, write_json
from experiments.runner import run_monitored, tail

# 3 distractor needles: an example's needles, question and answer take up to 197 tokens, so
# examples are packed in 256 tokens and more (`min_length=256`), one a sequence at 256.
DATASET = "needle:needles=1,distractors=3,loss=answer_end,eval_sequences=64"
COMMON = {"data.dataset": DATASET, "data.vocab_size": 1024, "data.batch_size": 8,
          "model.d_model": 128, "model.num_heads": 4, "train.learning_rate": 3e-3,
          "train.warmup_steps": 50, "train.weight_decay": 0.0, "train.log_every": 50,
          "train.eval_every": 500, "train.checkpoint_every": 250, "train.sample_prompt": "",
          "train.sample_tokens": 0, "train.seed": 100,
          "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1, "mesh.context": 1}
# Cheapest first: the shortest sequences tell soonest whether the lookup is learnt at all.
ROWS = {
    "k1": {"data.seq_len": 256, "model.num_layers": 2, "train.num_steps": 1500},
    "k2": {"data.seq_len": 512, "data.dataset": DATASET + ",min_length=256", "model.num_layers": 2,
           "train.num_steps": 2000},
    "k3": {"data.seq_len": 512, "data.dataset": DATASET + ",min_length=256", "model.num_layers": 4,
           "train.num_steps": 3000},
    # Added after k1-k3 (none near the gate): the shortest haystacks, the deeper model, longer.
    "k4": {"data.seq_len": 256, "model.num_layers": 4, "train.num_steps": 5000},
}
VARIANTS = ("multikey", "single")
GATE = 0.5  # multikey top-1 dense must reach before a key-lookup study is registered
RESULTS = os.path.join(REPO, "experiments", "results", "key_lookup_pilot.json")
FIGURES = os.path.join(REPO, "experiments", "results", "key_lookup_pilot")


def grid(seq_len: int) -> dict:
  """The needle grid at a row's length: lengths up to it (half, three quarters, all of it; at
  least 192, which a multikey prompt needs), 3 depths, 10 needles a cell."""
  lengths = ",".join(str(n) for n in sorted({max(192, seq_len * f // 4) for f in (2, 3, 4)}))
  return {"lengths": lengths, "depths": "0,0.5,1", "needles_per_cell": 10, "distractors": 9,
          "seed": 0}


def train_command(row: str, workdir: str) -> list[str]:
  settings = {**COMMON, **ROWS[row]}
  return [sys.executable, "-m", "efficient_lm.main", "--config=configs/dense.py",
          f"--workdir={workdir}", *[f"--config.{k}={v}" for k, v in settings.items()]]


def eval_command(workdir: str, out: str, seq_len: int, variant: str) -> list[str]:
  return [sys.executable, "-m", "efficient_lm.evaluate", f"--workdir={workdir}", "--task=needle",
          "--keys=words", f"--variant={variant}", *[f"--{k}={v}" for k, v in grid(seq_len).items()],
          f"--out={out}"]


def run_row(row: str, args) -> dict:
  workdir = os.path.join(args.workdir_root, row)
  os.makedirs(workdir, exist_ok=True)
  train = train_command(row, workdir)
  print(f"{row}: training", flush=True)
  run = run_monitored(train, workdir + ".log", args.pause_file)
  if run["returncode"] != 0:
    raise RuntimeError(f"{row} training failed:\n{tail(workdir + '.log')}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    final = [m for m in map(json.loads, f) if "eval_loss" in m][-1]
  out = {"row": row, "settings": {**COMMON, **ROWS[row]}, "answer_loss": final["eval_loss"],
         "train_seconds": run["seconds"], "cpu_seconds": run["cpu_seconds"],
         "load_mean": run["load_mean"], "command": " ".join(train), "variants": {}}
  for variant in VARIANTS:
    figures = os.path.join(args.figures, row, variant)
    score = eval_command(workdir, figures, ROWS[row]["data.seq_len"], variant)
    print(f"{row}: needle grid, {variant}", flush=True)
    log = f"{workdir}.{variant}.log"
    scored = run_monitored(score, log, args.pause_file)
    if scored["returncode"] != 0:
      raise RuntimeError(f"{row} {variant} failed:\n{tail(log)}")
    with open(os.path.join(figures, "needle.json")) as f:
      record = json.load(f)
    out["variants"][variant] = {
        **needle_study.by_reach(record),
        "chance_top1": record["chance"]["top1"], "step": record["step"],
        "figures": os.path.relpath(figures, REPO), "command": " ".join(score),
        "cpu_seconds": scored["cpu_seconds"]}
  from experiments.long_range import code_version  # pylint: disable=import-outside-toplevel
  out["code"] = code_version()
  return out


def render(results: dict) -> str:
  """experiments/README.md's `key_lookup_pilot` block: one line per finished row."""
  rows = results.get("rows", {})
  if not rows:
    return "No row has finished yet."
  fmt = lambda x: "-" if x is None else f"{x:.3f}"
  lines = ["| row | dataset | seq_len | layers | steps | answer loss | multikey top-1 (lowest cell) | multikey "
           "exact | single top-1 | single exact | gate (multikey top-1 >= 0.5) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for name, r in sorted(rows.items()):
    s, mk, one = r["settings"], r["variants"]["multikey"], r["variants"]["single"]
    lines.append(f"| {name} | `{s['data.dataset']}` | {s['data.seq_len']} | {s['model.num_layers']} | {s['train.num_steps']} "
                 f"| {r['answer_loss']:.4f} | {fmt(mk['top1_all'])} ({fmt(mk['min_cell_top1'])}) | "
                 f"{fmt(mk['exact_all'])} | {fmt(one['top1_all'])} | {fmt(one['exact_all'])} | "
                 f"{'met' if mk['top1_all'] >= GATE else 'not met'} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", default=",".join(ROWS))
  parser.add_argument("--force", action="store_true")
  parser.add_argument("--results", default=RESULTS)
  parser.add_argument("--figures", default=FIGURES)
  parser.add_argument("--workdir_root", default=os.path.join(REPO, "runs", "key_lookup_pilot"))
  parser.add_argument("--pause_file", default="")
  args = parser.parse_args(argv)
  unknown = sorted(set(args.rows.split(",")) - set(ROWS))
  if unknown:
    sys.exit(f"error: --rows: unknown {unknown}; use {', '.join(ROWS)}")
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the running row too
  results = needle_study.load(args.results) if os.path.isfile(args.results) else {}
  results.setdefault("rows", {})
  if isinstance(results["rows"], list):
    results["rows"] = {}
  for row in args.rows.split(","):
    if row not in results["rows"] or args.force:
      results["rows"][row] = run_row(row, args)
      results.update(dataset=DATASET, gate=GATE)
      write_json(args.results, results)
    mk = results["rows"][row]["variants"]["multikey"]
    print(f"{row}: multikey top-1 {mk['top1_all']:.3f}, exact {mk['exact_all']:.3f}", flush=True)


if __name__ == "__main__":
  main()
