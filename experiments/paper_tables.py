"""The papers' comparisons at small scale, on the embedded corpus: one row per (config, preset, seed).

    nice -n 19 python -m experiments.paper_tables --pause_file=/tmp/efficient_lm_quiet   # every row
    python -m experiments.paper_tables --tables=bcmt --models=bcmt:256,dense@1 --steps=50
    python -m experiments.paper_tables --bench --tables=pi     # side-by-side train-step tokens/s
    python -m experiments.paper_tables --render                # README tables and plots from the json

Each row is a real training run, `python -m efficient_lm.main` in a subprocess
(the exact command is stored with the row), with the table's shared settings:
the same context, batch, width, depth, steps and tokens for every model of a
table, and for one seed (`train.seed`: initialization and data order) the same
data order. Row keys name the seed: `bcmt:256@1`. After training, a second
subprocess scores the row's workdir with `efficient_lm.evaluate` (see SCORING)
and counts the compiled train step's temporary memory and FLOPs. Reported per
row: the training run's final validation loss and bits per byte, the scores,
the median train tokens/s of its log lines, the peak resident memory of the
training process (`ru_maxrss`), the parameter count, the wall clock with and
without paused time, and the load average sampled while it ran.

Queue: seed 0 of every two-seed row (table by table), then seed 1, then the
one-seed rows. Resumable and additive: rows are written to --results after
every run; a row already there is kept unless --force, and a row whose
training finished (its workdir under --workdir_root says so) but whose scoring
did not is scored without retraining (`--rescore` rescores kept rows too).
`--pause_file=PATH`: while PATH exists the running subprocess is stopped
(SIGSTOP) and continued (SIGCONT) once it is gone; paused time is left out of
the row's `seconds`. The markdown tables between the `<!-- paper_tables:<table> -->`
markers of --readme and the per-position plots next to --results are rendered
from the json.
"""

import argparse
import datetime
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys

from efficient_lm import stats
from experiments.common import REPO, load_config
from experiments.runner import run_monitored, tail as _tail

# Claims measured on the per-position curve, ('gain', far ranges, near ranges): a row's loss over
# the far positions minus its loss over the near ones; compared between two models on the same
# tokens, what the token mix adds to both cancels. BCMT: the first 8 positions of blocks 2-4
# (256-263, 512-519, 768-775), where HOnly has no context and BCMT its memory, against those of
# block 1. π: positions 512-2047, past the 4-layer sliding window's reach (4 x 127 = 508
# tokens), against 128-511.
BLOCK_STARTS = (((256, 264), (512, 520), (768, 776)), ((0, 8),))
PAST_REACH = (((512, 2048),), ((128, 512),))

# Shared settings per table (`section.field` -> value, applied to every row whose config has the
# field), the rows as (config key, seeds), per-row settings, and how rows are scored:
# 'per_position' (every position of non-overlapping seq_len windows, loss per position) or
# 'latents' (the last num_latents targets of each window, every token once, for every model; and
# every position for the models that predict them all).
TABLES = {
    "bcmt": {
        "title": "BCMT paper: dense vs BCMT vs HOnly (the ablation) at blocks 256 and 128",
        "settings": {"data.seq_len": 1024, "data.batch_size": 2, "model.d_model": 128,
                     "model.num_layers": 6, "model.num_heads": 4},
        "rows": [("dense", (0, 1)), ("bcmt:256", (0, 1)), ("bcmt:honly256", (0, 1)),
                 ("bcmt:128", (0,)), ("bcmt:honly128", (0,))],
        "row_settings": {},
        "scoring": "per_position",
        "bands": [(0, 256), (256, 512), (512, 1024)],
        "baseline": "bcmt:honly256",
        "marks": {"block 256 boundaries": (256, 512, 768)},
        "diff_bin": 8,
        "claims": [
            ("dense is ahead of BCMT-256", "dense", "bcmt:256", ("eval",),
             "4.5752 vs 4.5931: dense ahead by 0.018"),
            ("BCMT-256 is ahead of HOnly-256 (the memory helps)", "bcmt:256", "bcmt:honly256", ("eval",),
             "HOnly worse at every block size"),
            ("BCMT-128 is ahead of HOnly-128", "bcmt:128", "bcmt:honly128", ("eval",),
             "HOnly worse at every block size"),
            ("BCMT-256's memory is used: loss at the first 8 positions of blocks 2-4 minus at those of "
             "block 1 is lower than HOnly-256's", "bcmt:256", "bcmt:honly256", ("gain",) + BLOCK_STARTS,
             "(the memory's purpose: HOnly has no context there)"),
            ("control: dense gains there too (the same difference, dense below HOnly-256)", "dense",
             "bcmt:honly256", ("gain",) + BLOCK_STARTS, "(can this scale show a gain from context?)"),
        ],
    },
    "ecp": {
        "title": "ECP paper: Perceiver-AR vs Double vs Compressed vs s-Split vs ECP",
        "settings": {"data.seq_len": 512, "data.batch_size": 4, "model.d_model": 128,
                     "model.num_layers": 4, "model.num_heads": 4, "model.num_latents": 128,
                     "model.num_segments": 4},
        "rows": [("perceiver_ar", (0, 1)), ("ecp", (0, 1)), ("perceiver_ar:double", (0,)),
                 ("perceiver_ar:compressed", (0,)), ("perceiver_ar:ssplit", (0,))],
        "row_settings": {},
        "scoring": "latents",
        "claims": [
            ("ECP is ahead of Perceiver-AR on the same positions", "ecp", "perceiver_ar", ("latents",),
             "ECP ahead"),
            ("Double is ahead of Perceiver-AR", "perceiver_ar:double", "perceiver_ar", ("latents",),
             "Double ahead"),
            ("Compressed is ahead of Perceiver-AR", "perceiver_ar:compressed", "perceiver_ar", ("latents",),
             "Compressed ahead"),
            ("s-Split is ahead of Perceiver-AR", "perceiver_ar:ssplit", "perceiver_ar", ("latents",),
             "s-Split ahead"),
        ],
    },
    "pi": {
        "title": "π paper: dense vs sliding window vs π-Attention (constant and doubling periods)",
        "settings": {"data.seq_len": 2048, "data.batch_size": 1, "model.d_model": 128,
                     "model.num_layers": 4, "model.num_heads": 4, "model.window": 128,
                     "model.period": 128, "model.num_skips": 3},
        "rows": [("dense", (0, 1)), ("sliding_window", (0, 1)), ("pi_attention", (0, 1)),
                 ("pi_attention:doubling", (0, 1))],
        # The doubling schedule from base period 64: layer periods 64, 128, 256, 512 (the preset's).
        "row_settings": {"pi_attention:doubling": {"model.period": 64}},
        "scoring": "per_position",
        "bands": [(0, 128), (128, 512), (512, 2048)],
        "baseline": "sliding_window",
        "marks": {"window 128": (128,), "4-layer window reach 508": (508,)},
        "diff_bin": 32,
        "claims": [
            ("π is ahead of the sliding window", "pi_attention", "sliding_window", ("eval",),
             "perplexity 18.4 vs 20.1 (0.088 nats)"),
            ("dense is ahead of π", "dense", "pi_attention", ("eval",), "perplexity 18.3 vs 18.4 (0.005 nats)"),
            ("π uses context past the sliding window's reach: loss at positions 512-2047 minus at "
             "128-511 is lower than the sliding window's", "pi_attention", "sliding_window",
             ("gain",) + PAST_REACH, "(the skips' purpose)"),
            ("π doubling is ahead of the sliding window", "pi_attention:doubling", "sliding_window",
             ("eval",), "(not in the paper's tables: our growing-period reading)"),
            ("control: dense gains there (the same difference, dense below the sliding window)",
             "dense", "sliding_window", ("gain",) + PAST_REACH, "(can this scale show a gain from context?)"),
        ],
    },
}
# One epoch of the training plays (1,360,353 tokens) at 2,048 tokens a step.
DEFAULT_STEPS = 665
DEFAULT_RESULTS = os.path.join(REPO, "experiments", "results", "paper_tables.json")
DEFAULT_README = os.path.join(REPO, "experiments", "README.md")


def config_arg(key: str) -> str:
  """'bcmt:128' (or 'bcmt:128@1') -> 'configs/bcmt.py:128'; 'dense' -> 'configs/dense.py'."""
  name, _, preset = key.split("@")[0].partition(":")
  return f"configs/{name}.py" + (f":{preset}" if preset else "")


def row_key(config_key: str, seed: int) -> str:
  return f"{config_key}@{seed}"


def split_key(key: str) -> tuple[str, int]:
  """'bcmt:256@1' -> ('bcmt:256', 1)."""
  config_key, _, seed = key.partition("@")
  return config_key, int(seed or 0)


def all_row_keys(table: str) -> list[str]:
  return [row_key(k, s) for k, seeds in TABLES[table]["rows"] for s in seeds]


def queue(tables: list[str]) -> list[tuple[str, str]]:
  """(table, row key) in run order: seed 0 of the two-seed rows, then their seed 1, then the rest."""
  phases: list[list[tuple[str, str]]] = [[], [], []]
  for table in tables:
    for config_key, seeds in TABLES[table]["rows"]:
      for seed in seeds:
        phase = 2 if len(seeds) == 1 else min(seed, 1)
        phases[phase].append((table, row_key(config_key, seed)))
  return [item for phase in phases for item in phase]


def row_overrides(table: str, key: str, steps: int, extra: list[str]) -> dict[str, str]:
  """Every `section.field=value` the row's command sets, in order (later wins); a field the row's
  config lacks (model.window for dense) is left out."""
  config_key, seed = split_key(key)
  config = load_config(config_arg(config_key))

  def has(field: str) -> bool:
    section, _, name = field.partition(".")
    return section in config and name in config[section]

  out = {k: str(v) for k, v in TABLES[table]["settings"].items() if has(k)}
  out.update({k: str(v) for k, v in TABLES[table]["row_settings"].get(config_key, {}).items()})
  out.update({"train.num_steps": str(steps), "train.warmup_steps": str(max(1, steps // 10)),
              "train.log_every": str(max(1, steps // 20)), "train.eval_every": str(steps),
              "train.checkpoint_every": str(steps), "train.sample_tokens": "0",
              "train.seed": str(seed)})
  for item in extra:
    field, _, value = item.partition("=")
    if has(field):
      out[field] = value
  return out


def main_command(key: str, workdir: str, overrides: dict[str, str]) -> list[str]:
  return ([sys.executable, "-m", "efficient_lm.main", f"--config={config_arg(key)}", f"--workdir={workdir}"]
          + [f"--config.{k}={v}" for k, v in overrides.items()])


def quoted(command: list[str]) -> str:
  return " ".join(shlex.quote(c) for c in ["python"] + command[1:])


def _cast(old, value: str):
  if isinstance(old, bool):
    return value.lower() in ("1", "true")
  return type(old)(value) if old is not None else value


def configured(key: str, overrides: dict[str, str]):
  config = load_config(config_arg(key))
  for field, value in overrides.items():
    section, name = field.split(".", 1)
    if name in config[section]:
      config[section][name] = _cast(config[section][name], value)
  return config


def static_figures(key: str, overrides: dict[str, str]) -> dict:
  """Params, the compiled train step's temp memory and FLOPs (compile only, random tokens)."""
  import jax  # pylint: disable=import-outside-toplevel
  from experiments import bench_step  # pylint: disable=import-outside-toplevel
  config = configured(key, overrides)
  _, state, _, memory, _ = bench_step.compile_train_step(config)
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  return {"model_name": config.model.name, "params": int(num_params),
          "compiled_temp_mib": getattr(memory, "temp_size_in_bytes", float("nan")) / 2**20,
          "step_gflop": bench_step.train_step_flops(config) / 1e9}


# ----------------------------------------------------------------------------------------------
# Training and scoring one row.


def workdir_of(table: str, key: str, root: str) -> str:
  return os.path.join(root, table, key.replace(":", "_"))


def train_row(table: str, key: str, steps: int, args) -> dict:
  """Trains one row from scratch in a subprocess (or reuses a workdir whose training with this
  exact command finished); returns the training figures."""
  workdir = workdir_of(table, key, args.workdir_root)
  command = main_command(key, workdir, row_overrides(table, key, steps, args.override))
  marker = os.path.join(workdir, "trained.json")
  if os.path.exists(marker) and not args.force:
    with open(marker) as f:
      trained = json.load(f)
    if trained["command"] == quoted(command):
      print(f"{table}/{key}: training already finished in {workdir}; scoring it", flush=True)
      return trained
  shutil.rmtree(workdir, ignore_errors=True)  # a row is always a fresh run
  os.makedirs(workdir)
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  run = run_monitored(command, os.path.join(workdir, "log.txt"), args.pause_file, args.poll_seconds)
  if run["returncode"] != 0:
    raise RuntimeError(f"{key} ({table}) failed with status {run['returncode']}:\n"
                       f"{_tail(os.path.join(workdir, 'log.txt'))}")
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  evals = [r for r in records if "eval_loss" in r]
  rates = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r]
  config_key, seed = split_key(key)
  overrides = row_overrides(table, key, steps, args.override)
  trained = {
      "table": table, "key": key, "config_key": config_key, "seed": seed, "steps": steps,
      "tokens_per_step": int(overrides["data.batch_size"]) * int(overrides["data.seq_len"]),
      "eval_split": "validation", "eval_loss": evals[-1]["eval_loss"],
      "eval_bits_per_byte": evals[-1]["eval_bits_per_byte"],
      "train_tokens_per_sec": statistics.median(rates) if rates else float("nan"),
      "command": quoted(command), "code": code_version(), "started": started,
      "workdir": workdir, **{k: v for k, v in run.items() if k != "returncode"},
  }
  with open(marker, "w") as f:
    json.dump(trained, f, indent=1)
  return trained


def score_command(table: str, key: str, steps: int, args, out: str) -> list[str]:
  command = [sys.executable, "-m", "experiments.paper_tables", "--tables=" + table,
             "--score_row=" + key, f"--steps={steps}", "--score_out=" + out,
             "--workdir_root=" + args.workdir_root]
  return command + [f"--override={o}" for o in args.override]


def score_row_here(table: str, key: str, steps: int, args) -> dict:
  """The scoring stage, in this process: `efficient_lm.evaluate` on the row's workdir (validation)
  and the compiled step's figures. Returns {'static': ..., 'scores': ..., 'per_position': ...}."""
  from efficient_lm import generation, scoring  # pylint: disable=import-outside-toplevel
  workdir = workdir_of(table, key, args.workdir_root)
  overrides = row_overrides(table, key, steps, args.override)
  seq_len = int(overrides["data.seq_len"])
  scores, per_position = {}, {}
  if TABLES[table]["scoring"] == "per_position":
    r = scoring.evaluate_workdir(workdir, split="validation", context=seq_len, stride=seq_len,
                                  per_position=True)
    scores["windows"] = _figures(r)
    per_position["windows"] = _curve(r["per_position_loss"], r["per_position_count"])
    per_position["pooled"] = pooled_positions(workdir, r, seq_len)
  else:
    # Z: the table's num_latents (or an --override of it), for the models without latents too.
    latents = dict(o.partition("=")[::2] for o in args.override).get(
        "model.num_latents", TABLES[table]["settings"]["model.num_latents"])
    latents = min(int(latents), seq_len)
    r = scoring.evaluate_workdir(workdir, split="validation", context=seq_len, stride=latents)
    scores["last_latents"] = _figures(r)
    model, *_ = generation.load_workdir(workdir)
    if scoring.predicted_positions(model, seq_len) == seq_len:  # not latents only: every position too
      r = scoring.evaluate_workdir(workdir, split="validation", context=seq_len, stride=seq_len)
      scores["every"] = _figures(r)
  return {"static": static_figures(key, overrides), "scores": scores, "per_position": per_position}


# The per-position curve is also pooled over the windows starting at these fractions of seq_len
# into the stream (0 is the training eval's windows): 4x the tokens at every position.
POOLED_OFFSETS = (0.0, 0.25, 0.5, 0.75)


def pooled_positions(workdir: str, first: dict, seq_len: int) -> dict:
  """Per-position loss of non-overlapping seq_len windows pooled over `POOLED_OFFSETS` (the
  stream cut at offset * seq_len; `first` is the offset-0 result of `evaluate_workdir`)."""
  from efficient_lm import data, generation, scoring  # pylint: disable=import-outside-toplevel
  model, tokenizer, config, _ = generation.load_workdir(workdir)
  tokens = data.load(config.data).tokens("validation")
  nll = [0.0] * seq_len
  count = [0] * seq_len
  for offset in POOLED_OFFSETS:
    if offset == 0.0:
      r = first
    else:
      start = int(offset * seq_len)
      r = scoring.score_stream(model, tokens[start:], context=seq_len, stride=seq_len,
                                batch_size=config.data.batch_size, num_bytes=1, eos_id=tokenizer.eos_id,
                                pad_id=tokenizer.pad_id, per_position=True, seq_len=seq_len)
    for p, (loss, c) in enumerate(zip(r["per_position_loss"], r["per_position_count"])):
      if c:
        nll[p] += loss * c
        count[p] += c
  out = _curve([n / c if c else None for n, c in zip(nll, count)], count)
  out["offsets"] = [int(o * seq_len) for o in POOLED_OFFSETS]
  return out


def _curve(loss: list, count: list) -> dict:
  return {"loss": [None if v is None else round(v, 5) for v in loss], "count": count}


def _figures(result: dict) -> dict:
  return {k: result[k] for k in ("loss", "bits_per_byte", "scored_tokens", "target_tokens", "context",
                                 "stride", "step")}


def score_row(table: str, key: str, steps: int, args) -> dict:
  """Runs the scoring stage in a pausable subprocess; returns what it wrote."""
  workdir = workdir_of(table, key, args.workdir_root)
  out = os.path.join(workdir, "scores.json")
  if os.path.exists(out):
    os.remove(out)
  command = score_command(table, key, steps, args, out)
  run = run_monitored(command, os.path.join(workdir, "score_log.txt"), args.pause_file,
                      args.poll_seconds)
  if run["returncode"] != 0:
    raise RuntimeError(f"scoring {key} ({table}) failed with status {run['returncode']}:\n"
                       f"{_tail(os.path.join(workdir, 'score_log.txt'))}")
  with open(out) as f:
    scored = json.load(f)
  scored["score_command"] = quoted(command)
  scored["score_seconds"] = run["seconds"]
  scored["score_cpu_seconds"] = run["cpu_seconds"]
  return scored


def code_version() -> str:
  """The commit the rows ran at (a snapshot's SNAPSHOT_COMMIT file, else `git rev-parse`), '+dirty' if edited."""
  marker = os.path.join(REPO, "SNAPSHOT_COMMIT")
  if os.path.exists(marker):
    return open(marker).read().strip() + " (snapshot: git archive of that commit + experiments/)"
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "efficient_lm", "configs"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return commit + ("+dirty" if dirty else "")
  except OSError:
    return "unknown"


# ----------------------------------------------------------------------------------------------
# The json files.


def load_json(path: str, empty: dict) -> dict:
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  return empty


def save_json(results: dict, path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(results, f, indent=1, sort_keys=True)
  os.replace(tmp, path)


def per_position_path(results_path: str) -> str:
  return os.path.splitext(results_path)[0] + "_per_position.json"


# ----------------------------------------------------------------------------------------------
# Rendering: tables, bands, plots.


def seed_stats(values: list[float]) -> str:
  """'4.4321' for one value; '4.4321 (4.4300-4.4342)': mean (min-max) for several ('to' between
  negative ones)."""
  if len(values) == 1:
    return f"{values[0]:.4f}"
  dash = "-" if min(values) >= 0 else " to "
  return f"{statistics.fmean(values):.4f} ({min(values):.4f}{dash}{max(values):.4f})"


def curve_of(row_positions: dict) -> dict:
  """The row's per-position curve: pooled over the offsets where scored so, else offset 0's."""
  return row_positions.get("pooled") or row_positions["windows"]


def ranges_loss(per_position: dict, ranges) -> float:
  """Mean loss (weighted by scored tokens) over the positions of the (lo, hi) ranges."""
  loss, count = per_position["loss"], per_position["count"]
  where = [p for lo, hi in ranges for p in range(lo, min(hi, len(loss))) if count[p]]
  n = sum(count[p] for p in where)
  return sum(loss[p] * count[p] for p in where) / n if n else float("nan")


def band_loss(per_position: dict, lo: int, hi: int) -> float:
  return ranges_loss(per_position, ((lo, hi),))


def grouped(rows: dict, table: str) -> list[tuple[str, list[dict]]]:
  """(config key, its rows by seed) in the table's order, then any others."""
  by_key: dict[str, list[dict]] = {}
  for key in sorted(rows, key=lambda k: split_key(k)[1]):
    if "config_key" in rows[key]:
      by_key.setdefault(rows[key]["config_key"], []).append(rows[key])
  order = [k for k, _ in TABLES[table]["rows"] if k in by_key] + sorted(set(by_key) - {k for k, _ in
                                                                                      TABLES[table]["rows"]})
  return [(k, by_key[k]) for k in order]


def render_table(table: str, entry: dict, positions: dict) -> str:
  """Markdown for one table: a line per config key with the mean (min-max) over its seeds."""
  rows = entry.get("rows", {})
  groups = [(k, [r for r in rs if "scores" in r]) for k, rs in grouped(rows, table)]
  groups = [(k, rs) for k, rs in groups if rs]
  if not groups:
    return "(no rows yet: `python -m experiments.paper_tables --tables=%s`)" % table
  bench = entry.get("bench", {}).get("rows", {})
  spec = TABLES[table]
  if spec["scoring"] == "per_position":
    bands = spec["bands"]
    head = (["model", "seeds", "val loss", "bits/byte"] + [f"loss at positions {lo}-{hi - 1}" for lo, hi in bands])
  else:
    head = ["model", "seeds", "training eval loss (own positions)",
            f"last {spec['settings']['model.num_latents']} of each window: loss", "bits/byte",
            "every position: loss", "bits/byte"]
  head += ["compiled temp MiB", "GFLOP/step", "params", "tokens/s (side by side)", "min/row", "load"]
  lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
  for config_key, rs in groups:
    seeds = ",".join(str(r["seed"]) for r in rs)
    cells = [f"`{config_key}`", seeds]
    if spec["scoring"] == "per_position":
      cells += [seed_stats([r["eval_loss"] for r in rs]), seed_stats([r["eval_bits_per_byte"] for r in rs])]
      for lo, hi in bands:
        cells.append(seed_stats([band_loss(curve_of(positions[r["key"]]), lo, hi) for r in rs
                                 if r["key"] in positions]) if all(r["key"] in positions for r in rs) else "")
    else:
      cells.append(seed_stats([r["eval_loss"] for r in rs]))
      cells += [seed_stats([r["scores"]["last_latents"]["loss"] for r in rs]),
                seed_stats([r["scores"]["last_latents"]["bits_per_byte"] for r in rs])]
      if all("every" in r["scores"] for r in rs):
        cells += [seed_stats([r["scores"]["every"]["loss"] for r in rs]),
                  seed_stats([r["scores"]["every"]["bits_per_byte"] for r in rs])]
      else:
        cells += ["(latents only)", ""]
    r0 = rs[0]
    b = bench.get(config_key)
    cells += [f"{r0['compiled_temp_mib']:,.1f}", f"{r0['step_gflop']:,.1f}", f"{r0['params']:,}",
              f"{b['tokens_per_sec']:,.0f}" if b else "",
              f"{statistics.fmean(r['seconds'] for r in rs) / 60:.0f}",
              f"{statistics.fmean(r['load_mean'] for r in rs):.1f}"]
    lines.append("| " + " | ".join(cells) + " |")
  steps = {r["steps"] for _, rs in groups for r in rs}
  settings = ", ".join(f"{k}={v}" for k, v in spec["settings"].items())
  extra = "".join(f"; `{k}`: " + ", ".join(f"{f}={v}" for f, v in s.items())
                  for k, s in spec["row_settings"].items())
  lines.append("")
  lines.append(f"Steps: {', '.join(map(str, sorted(steps)))}. Shared settings: {settings}{extra}. "
               "Two-seed cells: mean (min-max)."
               + (" Position columns: the per-position validation loss of non-overlapping windows, "
                  "pooled over the windows starting at 0, 1/4, 1/2 and 3/4 of the context into the "
                  "split." if spec["scoring"] == "per_position" else "")
               + " Each row's exact command, seed, wall clock and load are in "
               "`experiments/results/paper_tables.json`.")
  if entry.get("bench"):
    lines.append(f"Side-by-side tokens/s: `{entry['bench']['command']}` (median of "
                 f"{entry['bench']['repeats']} steps, uptime before: {entry['bench']['uptime_before']}).")
  return "\n".join(lines)


def metric_values(rows: list[dict], metric: tuple, positions: dict) -> list[float] | None:
  """One value per seed row: ('eval',) the training eval's loss; ('latents',) the last-Z score;
  ('band', lo, hi) the per-position loss over positions lo..hi-1; ('gain', far, near) the loss over
  the `far` position ranges minus over the `near` ones. None while a row lacks its curve."""
  if metric[0] == "eval":
    return [r["eval_loss"] for r in rows]
  if metric[0] == "latents":
    return [r["scores"]["last_latents"]["loss"] for r in rows]
  if not all(r["key"] in positions for r in rows):
    return None
  curves = [curve_of(positions[r["key"]]) for r in rows]
  if metric[0] == "band":
    return [band_loss(c, metric[1], metric[2]) for c in curves]
  return [ranges_loss(c, metric[1]) - ranges_loss(c, metric[2]) for c in curves]


def verdict(better: dict[int, float], worse: dict[int, float]) -> tuple[float, str, str]:
  """(gap = mean over paired seeds of worse - better, its p-value and 95% interval, the verdict),
  by the rule of `efficient_lm.stats` (written before the runs): a paired t-test over the seeds
  both rows have (`train.seed` fixes the data order: same-seed runs are pairs); confirmed when
  p < 0.05 and the interval lies above 0, refuted when below; a one-seed side is not decided. Its
  false-positive rate is 5% (the old "gap > the larger seed spread" rule's was about 22%)."""
  test = stats.paired_t_test(better, worse)  # lower is better: positive = `better` ahead
  decision = stats.decide("", test)
  if test.n < 2:
    return test.difference, "one seed: not tested", "not decided (one seed)"
  detail = f"p={test.p_value:.3f}, [{test.ci_low:+.4f}, {test.ci_high:+.4f}]"
  return test.difference, detail, (f"**{decision.verdict}**" if decision.verdict in (
      stats.CONFIRMED, stats.REFUTED) else decision.verdict)


def render_claims(table: str, entry: dict, positions: dict) -> str:
  """The table's claims, each judged by `verdict` on the rows there are."""
  groups = {k: [r for r in rs if "scores" in r] for k, rs in grouped(entry.get("rows", {}), table)}
  lines = ["| claim (lower loss is ahead) | the paper | ours (mean, min-max over seeds) | gap | "
           "paired t over seeds (p, 95% interval) | verdict |", "| --- | --- | --- | --- | --- | --- |"]
  for text, better, worse, metric, paper in TABLES[table].get("claims", []):
    a, b = groups.get(better), groups.get(worse)
    va = metric_values(a, metric, positions) if a else None
    vb = metric_values(b, metric, positions) if b else None
    if va is None or vb is None:
      lines.append(f"| {text} | {paper} | (rows not run yet) | | | |")
      continue
    by_seed = lambda rows, values: {r["seed"]: v for r, v in zip(rows, values)}
    gap, detail, decided = verdict(by_seed(a, va), by_seed(b, vb))
    lines.append(f"| {text} | {paper} | `{better}` {seed_stats(va)} vs `{worse}` {seed_stats(vb)} | "
                 f"{gap:+.4f} | {detail} | {decided} |")
  return "\n".join(lines)


def position_bins(T: int) -> list[tuple[int, int]]:
  """Half-octave bins of window positions: [0, 1), [1, 2), [2, 3), [3, 4), [4, 6), ... up to T."""
  edges = sorted({0, T} | {int(round(2 ** (k / 2))) for k in range(int(2 * math.log2(T)) + 1)})
  return [(lo, hi) for lo, hi in zip(edges, edges[1:]) if lo < T]


def mean_curve(per_positions: list[dict]) -> list[float]:
  """Per-position loss averaged over seeds (positions every seed scored)."""
  length = len(per_positions[0]["loss"])
  out = []
  for p in range(length):
    values = [pp["loss"][p] for pp in per_positions if pp["count"][p]]
    out.append(statistics.fmean(values) if len(values) == len(per_positions) else float("nan"))
  return out


def binned(curve: list[float], counts: list[int], bins) -> tuple[list[float], list[float]]:
  xs, ys = [], []
  for lo, hi in bins:
    ps = [p for p in range(lo, hi) if counts[p] and not math.isnan(curve[p])]
    if ps:
      n = sum(counts[p] for p in ps)
      xs.append(sum((p + 1) * counts[p] for p in ps) / n)
      ys.append(sum(curve[p] * counts[p] for p in ps) / n)
  return xs, ys


def plot_positions(table: str, rows: dict, positions: dict, path: str) -> bool:
  """Two panels, every model of the table, mean over seeds: validation loss against window
  position (half-octave bins, log scale), and each model's loss minus the table's baseline's at
  the same positions (same tokens, so what the token mix adds cancels; bins of `diff_bin`
  positions, linear scale, where block starts and the window's reach show)."""
  groups = [(k, [r for r in rs if r["key"] in positions]) for k, rs in grouped(rows, table)]
  groups = [(k, rs) for k, rs in groups if rs]
  if not groups:
    return False
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  spec = TABLES[table]
  curves = {}
  for config_key, rs in groups:
    pps = [curve_of(positions[r["key"]]) for r in rs]
    curves[config_key] = (mean_curve(pps), pps[0]["count"], len(rs))
  T = len(next(iter(curves.values()))[0])
  base = curves.get(spec["baseline"])
  step = spec.get("diff_bin", max(1, T // 64))
  linear_bins = [(lo, min(lo + step, T)) for lo in range(0, T, step)]
  fig, (ax, dax) = plt.subplots(2, 1, figsize=(8, 8), gridspec_kw={"height_ratios": [3, 2]})
  for config_key, (curve, counts, n) in curves.items():
    xs, ys = binned(curve, counts, position_bins(T))
    line, = ax.plot(xs, ys, marker=".", lw=1.2, label=f"{config_key} ({n} seed{'s' if n > 1 else ''})")
    if base is not None:
      dxs, dys = binned([c - b for c, b in zip(curve, base[0])], counts, linear_bins)
      dax.plot([x - 1 for x in dxs], dys, lw=1.2, color=line.get_color())
  for name, where in spec.get("marks", {}).items():
    for at in where:
      ax.axvline(at + 1, color="gray", ls=":", lw=1)
      dax.axvline(at, color="gray", ls=":", lw=1)
    ax.text(where[0] + 1, ax.get_ylim()[1], f" {name}", va="top", fontsize=8, color="gray", rotation=90)
  ax.set_xscale("log")
  ax.set_ylabel("validation loss (nats/token)")
  ax.set_xlabel("position in the window + 1 (log scale)")
  ax.set_title(f"{spec['title']}\nvalidation loss against position (context {T}; 4 window offsets "
               "pooled; mean over seeds)", fontsize=9)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, which="both")
  dax.axhline(0, color="black", lw=0.8)
  dax.set_xlim(0, T)
  dax.set_ylabel(f"loss minus {spec['baseline']}'s")
  dax.set_xlabel(f"position in the window (bins of {step})")
  dax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def render_readme(results: dict, positions: dict, readme: str) -> None:
  """Replaces the text between `<!-- paper_tables:T -->` and `<!-- /paper_tables:T -->`."""
  if not os.path.exists(readme):
    return
  with open(readme) as f:
    text = f.read()
  for table in TABLES:
    begin, end = f"<!-- paper_tables:{table} -->", f"<!-- /paper_tables:{table} -->"
    if begin in text and end in text:
      head, rest = text.split(begin, 1)
      _, tail = rest.split(end, 1)
      body = render_table(table, results["tables"].get(table, {}), positions.get(table, {}))
      text = f"{head}{begin}\n{body}\n{end}{tail}"
    begin, end = f"<!-- paper_tables:{table}_claims -->", f"<!-- /paper_tables:{table}_claims -->"
    if begin in text and end in text:
      head, rest = text.split(begin, 1)
      _, tail = rest.split(end, 1)
      body = render_claims(table, results["tables"].get(table, {}), positions.get(table, {}))
      text = f"{head}{begin}\n{body}\n{end}{tail}"
  with open(readme, "w") as f:
    f.write(text)


def render_all(results: dict, positions: dict, args) -> None:
  render_readme(results, positions, args.readme)
  for table, spec in TABLES.items():
    if spec["scoring"] == "per_position":
      rows = results["tables"].get(table, {}).get("rows", {})
      plot_positions(table, rows, positions.get(table, {}),
                     os.path.join(os.path.dirname(os.path.abspath(args.results)),
                                  f"paper_tables_{table}_positions.png"))


# ----------------------------------------------------------------------------------------------
# Side-by-side speed: one bench_step run per table.


def bench_table(table: str, args) -> dict:
  """`python -m experiments.bench_step` over the table's models at its sizes, in one process."""
  s = TABLES[table]["settings"]
  keys = [k for k, _ in TABLES[table]["rows"]]
  command = [sys.executable, "-m", "experiments.bench_step", "--configs=" + ",".join(config_arg(k) for k in keys),
             f"--seq_len={s['data.seq_len']}", f"--batch_size={s['data.batch_size']}",
             f"--d_model={s['model.d_model']}", f"--num_layers={s['model.num_layers']}",
             f"--num_heads={s['model.num_heads']}", f"--repeats={args.bench_repeats}"]
  uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
  if result.returncode != 0:
    raise RuntimeError(f"bench_step for {table} failed:\n{result.stderr[-2000:]}")
  rows = {}
  by_spec = {config_arg(k): k for k in keys}
  for line in result.stdout.splitlines():
    spec, sep, rest = line.partition(": ")
    if sep and spec in by_spec and "tokens/s" in rest:
      rows[by_spec[spec]] = {"tokens_per_sec": float(rest.split(" tokens/s")[0].replace(",", ""))}
  return {"command": quoted(command), "repeats": args.bench_repeats, "uptime_before": uptime,
          "uptime_after": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
          "code": code_version(), "stdout": result.stdout, "rows": rows,
          "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


# ----------------------------------------------------------------------------------------------
# The command line.


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tables", default=",".join(TABLES), help="which tables: bcmt, ecp, pi")
  parser.add_argument("--models", default="",
                      help="rows to run: config keys (every seed) or row keys, e.g. bcmt:128,dense@1 "
                      "(default: all)")
  parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps per row")
  parser.add_argument("--force", action="store_true", help="retrain rows already in the results")
  parser.add_argument("--rescore", action="store_true", help="rescore kept rows from their workdirs")
  parser.add_argument("--override", action="append", default=[],
                      help="section.field=value for every row that has the field, e.g. "
                      "data.data_dir=/tmp/d (after the table's)")
  parser.add_argument("--results", default=DEFAULT_RESULTS)
  parser.add_argument("--readme", default=DEFAULT_README)
  parser.add_argument("--workdir_root", default="/tmp/paper_tables_runs")
  parser.add_argument("--pause_file", default="",
                      help="while this file exists the running row is stopped (SIGSTOP), then continued")
  parser.add_argument("--poll_seconds", type=float, default=10.0, help="how often the pause file and "
                      "the load average are checked")
  parser.add_argument("--render", action="store_true", help="only render the README and plots from the json")
  parser.add_argument("--bench", action="store_true",
                      help="only run bench_step once per table (all its models) and store the tokens/s")
  parser.add_argument("--bench_repeats", type=int, default=7)
  parser.add_argument("--score_row", default="", help=argparse.SUPPRESS)  # the scoring subprocess
  parser.add_argument("--score_out", default="", help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def main():
  args = parse_args()
  tables = list(filter(None, args.tables.split(",")))
  for table in tables:
    if table not in TABLES:
      sys.exit(f"error: --tables: unknown table {table!r}; use {', '.join(TABLES)}")
  if args.score_row:
    save_json(score_row_here(tables[0], args.score_row, args.steps, args), args.score_out)
    return
  wanted = set(filter(None, args.models.split(",")))
  known = {k for t in TABLES for k in all_row_keys(t)} | {k for t in TABLES.values() for k, _ in t["rows"]}
  if wanted - known:
    sys.exit(f"error: --models: unknown rows {sorted(wanted - known)}; see TABLES in "
             "experiments/paper_tables.py (row keys are <config key>@<seed>)")
  results = load_json(args.results, {"tables": {}})
  results.setdefault("tables", {})
  positions_path = per_position_path(args.results)
  positions = load_json(positions_path, {})
  if args.render:
    render_all(results, positions, args)
    return
  if args.bench:
    for table in tables:
      print(f"{table}: bench_step ...", flush=True)
      entry = results["tables"].setdefault(table, {"rows": {}})
      entry["bench"] = bench_table(table, args)
      save_json(results, args.results)
      print(entry["bench"]["stdout"], flush=True)
    render_all(results, positions, args)
    return

  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the running row too (run_monitored)
  failed = []
  for table, key in queue(tables):
    if wanted and key not in wanted and split_key(key)[0] not in wanted:
      continue
    entry = results["tables"].setdefault(table, {"rows": {}})
    entry["settings"] = TABLES[table]["settings"]
    kept = entry["rows"].get(key)
    if kept and not args.force and not args.rescore:
      print(f"{table}/{key}: kept (finished {kept['finished']}); --force to redo", flush=True)
      continue
    try:
      if kept and args.rescore and not args.force:
        trained = {k: v for k, v in kept.items() if k not in ("scores", "finished")}
        print(f"{table}/{key}: rescoring {trained['workdir']} ...", flush=True)
      else:
        print(f"{table}/{key}: training {args.steps} steps ...", flush=True)
        trained = train_row(table, key, args.steps, args)
      scored = score_row(table, key, args.steps, args)
    except RuntimeError as e:  # the row is not saved: the next run of the queue redoes it
      print(f"{table}/{key}: FAILED: {e}", flush=True)
      failed.append(f"{table}/{key}")
      continue
    row = {**trained, **scored["static"], "scores": scored["scores"],
           "score_command": scored["score_command"], "score_seconds": scored["score_seconds"],
           "score_cpu_seconds": scored["score_cpu_seconds"],
           "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    results = load_json(args.results, {"tables": {}})  # what another run (--bench) saved meanwhile
    entry = results.setdefault("tables", {}).setdefault(table, {"rows": {}})
    entry["settings"] = TABLES[table]["settings"]
    entry["rows"][key] = row
    if scored["per_position"]:
      positions = load_json(positions_path, {})
      positions.setdefault(table, {})[key] = scored["per_position"]
      save_json(positions, positions_path)
    save_json(results, args.results)
    render_all(results, positions, args)
    main_score = scored["scores"].get("windows") or scored["scores"]["last_latents"]
    print(f"{table}/{key}: training eval loss {row['eval_loss']:.4f} ({row['eval_bits_per_byte']:.4f} "
          f"bits/byte); scored {main_score['loss']:.4f}; {row['seconds']:.0f} s "
          f"({row['paused_seconds']:.0f} s paused), load {row['load_mean']:.1f}", flush=True)
  render_all(results, positions, args)
  for table in tables:
    print(f"\n## {table}\n\n" + render_table(table, results["tables"].get(table, {}), positions.get(table, {})))
  if failed:
    sys.exit(f"error: {len(failed)} row(s) failed and were not saved: {', '.join(failed)}; "
             "rerun the same command to redo them")


if __name__ == "__main__":
  main()
