"""Training and scoring one row, each in a pausable subprocess (`experiments.runner`)."""

import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys

from experiments.common import REPO
from experiments.paper_tables.specs import (TABLES, main_command, quoted, row_overrides,
                                            split_key, static_figures)
from experiments.runner import run_monitored, tail as _tail

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
      "table": table, "key": key, "config_key": config_key, "seed": seed,
      "steps": int(overrides["train.num_steps"]),
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
  from efficient_lm.inference import restore  # pylint: disable=import-outside-toplevel
  from efficient_lm.evaluation import scoring  # pylint: disable=import-outside-toplevel
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
    model = restore.restore(workdir, exports=False).model
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
  from efficient_lm import data  # pylint: disable=import-outside-toplevel
  from efficient_lm.evaluation import scoring  # pylint: disable=import-outside-toplevel
  from efficient_lm.inference import restore  # pylint: disable=import-outside-toplevel
  restored = restore.restore(workdir, exports=False)
  model, tokenizer, config = restored.model, restored.tokenizer, restored.config
  tokens = data.load(data.validate(config.data)).tokens("validation")
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
