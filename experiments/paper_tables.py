"""The papers' comparisons at small scale, on the embedded corpus: one row per (config, preset).

    nice -n 5 python -m experiments.paper_tables                      # every table, every row
    python -m experiments.paper_tables --tables=bcmt --models=bcmt:128,dense --steps=50
    python -m experiments.paper_tables --render                       # README tables from the json only

Each row is a real training run, `python -m efficient_lm.main` in a subprocess
(the exact command is stored with the row), with the table's shared settings:
the same context, batch, width, depth, steps and token budget for every model
of a table. Reported per row: the final validation (hamlet, twelfth_night) loss
and bits per byte, the median train tokens/s of the run's log lines, the peak
resident memory of the training process (its own `ru_maxrss`), the compiled
train step's temporary memory and FLOPs (`memory_analysis`, `cost_analysis`),
the parameter count and the wall clock.

Resumable and additive: rows are written to --results after every run; a row
already there is kept unless --force. The markdown tables between the
`<!-- paper_tables:<table> -->` markers of --readme are rendered from the json.
"""

import argparse
import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time

from experiments.common import REPO, load_config

# Shared settings per table: `section.field` -> value, applied to every row's config.
TABLES = {
    "bcmt": {
        "title": "BCMT paper: dense vs BCMT vs HOnly (the ablation) at each block size",
        "settings": {"data.seq_len": 1024, "data.batch_size": 2, "model.d_model": 128,
                     "model.num_layers": 6, "model.num_heads": 4},
        "steps": 120,
        "rows": ["dense", "bcmt:64", "bcmt:128", "bcmt:256", "bcmt:512",
                 "bcmt:honly64", "bcmt:honly128", "bcmt:honly256", "bcmt:honly512"],
    },
    "ecp": {
        "title": "ECP paper: PerceiverAR vs Double vs Compressed vs s-Split vs ECP",
        "settings": {"data.seq_len": 512, "data.batch_size": 4, "model.d_model": 128,
                     "model.num_layers": 4, "model.num_heads": 4},
        "steps": 120,
        "rows": ["perceiver_ar", "perceiver_ar:double", "perceiver_ar:compressed",
                 "perceiver_ar:ssplit", "ecp"],
    },
    "pi": {
        "title": "π paper: dense vs sliding window vs π-Attention (constant and doubling periods)",
        "settings": {"data.seq_len": 1024, "data.batch_size": 2, "model.d_model": 128,
                     "model.num_layers": 4, "model.num_heads": 4},
        "steps": 120,
        "rows": ["dense", "sliding_window", "pi_attention", "pi_attention:doubling"],
    },
}
DEFAULT_RESULTS = os.path.join(REPO, "experiments", "results", "paper_tables.json")
DEFAULT_README = os.path.join(REPO, "experiments", "README.md")


def config_arg(key: str) -> str:
  """'bcmt:128' -> 'configs/bcmt.py:128'; 'dense' -> 'configs/dense.py'."""
  name, _, preset = key.partition(":")
  return f"configs/{name}.py" + (f":{preset}" if preset else "")


def row_overrides(table: str, key: str, steps: int, extra: list[str]) -> dict[str, str]:
  """Every `section.field=value` the row's command sets, in order (later wins); an --override
  of a field the row's config lacks (model.window for dense) is left out."""
  config = load_config(config_arg(key))
  out = {k: str(v) for k, v in TABLES[table]["settings"].items()}
  out.update({"train.num_steps": str(steps), "train.warmup_steps": str(max(1, steps // 10)),
              "train.log_every": str(max(1, steps // 10)), "train.eval_every": str(steps),
              "train.checkpoint_every": str(steps), "train.sample_tokens": "0"})
  for item in extra:
    field, _, value = item.partition("=")
    section, _, name = field.partition(".")
    if section in config and name in config[section]:
      out[field] = value
  return out


def main_command(key: str, workdir: str, overrides: dict[str, str]) -> list[str]:
  return ([sys.executable, "-m", "efficient_lm.main", f"--config={config_arg(key)}", f"--workdir={workdir}"]
          + [f"--config.{k}={v}" for k, v in overrides.items()])


def _cast(old, value: str):
  if isinstance(old, bool):
    return value.lower() in ("1", "true")
  return type(old)(value) if old is not None else value


def static_figures(key: str, overrides: dict[str, str]) -> dict:
  """Params, the compiled train step's temp memory and FLOPs (compile only, random tokens)."""
  import jax  # imported here: the parent process needs jax only for this
  from experiments import bench_step
  config = load_config(config_arg(key))
  for field, value in overrides.items():
    section, name = field.split(".", 1)
    if name in config[section]:
      config[section][name] = _cast(config[section][name], value)
  _, state, _, memory, _ = bench_step.compile_train_step(config)
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  return {"model_name": config.model.name, "params": int(num_params),
          "compiled_temp_mib": getattr(memory, "temp_size_in_bytes", float("nan")) / 2**20,
          "step_gflop": bench_step.train_step_flops(config) / 1e9}


def run_row(table: str, key: str, steps: int, args) -> dict:
  """Trains one row from scratch in a subprocess; returns its figures."""
  workdir = os.path.join(args.workdir_root, table, key.replace(":", "_"))
  shutil.rmtree(workdir, ignore_errors=True)  # a row is always a fresh run
  os.makedirs(workdir)
  overrides = row_overrides(table, key, steps, args.override)
  command = main_command(key, workdir, overrides)
  start = time.perf_counter()
  with open(os.path.join(workdir, "log.txt"), "w") as log:
    proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
  seconds = time.perf_counter() - start
  if proc.returncode != 0:
    with open(os.path.join(workdir, "log.txt")) as f:
      tail = f.read()[-2000:]
    raise RuntimeError(f"{key} ({table}) failed with status {proc.returncode}:\n{tail}")
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  evals = [r for r in records if "eval_loss" in r]
  rates = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r]
  row = {
      "table": table, "key": key, "steps": steps,
      "tokens_per_step": int(overrides["data.batch_size"]) * int(overrides["data.seq_len"]),
      "eval_split": "validation", "eval_loss": evals[-1]["eval_loss"],
      "eval_bits_per_byte": evals[-1]["eval_bits_per_byte"],
      "train_tokens_per_sec": statistics.median(rates) if rates else float("nan"),
      "peak_rss_mib": usage.ru_maxrss / 1024,  # Linux reports KiB
      "seconds": seconds,
      "command": " ".join(shlex.quote(c) for c in ["python"] + command[1:]),
      "code": code_version(),
      "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  row.update(static_figures(key, overrides))
  return row


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


def load_results(path: str) -> dict:
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  return {"tables": {}}


def save_results(results: dict, path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(results, f, indent=1, sort_keys=True)
  os.replace(tmp, path)


def render_table(table: str, rows: dict) -> str:
  """Markdown for one table, rows in the table's order, then any others."""
  order = [k for k in TABLES[table]["rows"] if k in rows] + sorted(set(rows) - set(TABLES[table]["rows"]))
  if not order:
    return "(no rows yet: `python -m experiments.paper_tables --tables=%s`)" % table
  lines = ["| row | model_name | steps | val loss | bits/byte | train tokens/s | compiled temp MiB | "
           "peak RSS MiB | params | GFLOP/step | seconds |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for key in order:
    r = rows[key]
    lines.append(f"| `{key}` | {r['model_name']} | {r['steps']} | {r['eval_loss']:.4f} | "
                 f"{r['eval_bits_per_byte']:.4f} | {r['train_tokens_per_sec']:,.0f} | "
                 f"{r['compiled_temp_mib']:,.1f} | {r['peak_rss_mib']:,.0f} | {r['params']:,} | "
                 f"{r['step_gflop']:,.1f} | {r['seconds']:,.0f} |")
  settings = ", ".join(f"{k}={v}" for k, v in TABLES[table]["settings"].items())
  lines.append("")
  lines.append(f"Shared settings: {settings}. Each row's exact command is in "
               "`experiments/results/paper_tables.json` (`command`).")
  return "\n".join(lines)


def render_readme(results: dict, readme: str) -> None:
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
      body = render_table(table, results["tables"].get(table, {}).get("rows", {}))
      text = f"{head}{begin}\n{body}\n{end}{tail}"
  with open(readme, "w") as f:
    f.write(text)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tables", default=",".join(TABLES), help="which tables: bcmt, ecp, pi")
  parser.add_argument("--models", default="", help="row keys to run, e.g. bcmt:128,dense (default: all)")
  parser.add_argument("--steps", type=int, default=0, help="steps per row (default: the table's)")
  parser.add_argument("--force", action="store_true", help="rerun rows already in the results")
  parser.add_argument("--override", action="append", default=[],
                      help="section.field=value for every row, e.g. data.data_dir=/tmp/d (after the table's)")
  parser.add_argument("--results", default=DEFAULT_RESULTS)
  parser.add_argument("--readme", default=DEFAULT_README)
  parser.add_argument("--workdir_root", default="/tmp/paper_tables_runs")
  parser.add_argument("--render", action="store_true", help="only render the README from the json")
  parser.add_argument("--recount_flops", action="store_true",
                      help="recompute step_gflop of the rows kept (bench_step.train_step_flops), no training")
  args = parser.parse_args()

  results = load_results(args.results)
  wanted = set(filter(None, args.models.split(",")))
  for table in filter(None, args.tables.split(",")):
    if table not in TABLES:
      sys.exit(f"error: --tables: unknown table {table!r}; use {', '.join(TABLES)}")
    unknown = wanted - {k for t in TABLES.values() for k in t["rows"]}
    if unknown:
      sys.exit(f"error: --models: unknown rows {sorted(unknown)}; see TABLES in experiments/paper_tables.py")
    if args.render:
      continue
    if args.recount_flops:
      from experiments import bench_step
      for key, row in results["tables"].get(table, {}).get("rows", {}).items():
        config = load_config(config_arg(key))
        for field, value in row_overrides(table, key, row["steps"], args.override).items():
          section, name = field.split(".", 1)
          config[section][name] = _cast(config[section][name], value)
        row["step_gflop"] = bench_step.train_step_flops(config) / 1e9
        print(f"{table}/{key}: {row['step_gflop']:.2f} GFLOP/step", flush=True)
      save_results(results, args.results)
      continue
    entry = results["tables"].setdefault(table, {"rows": {}})
    entry["settings"] = TABLES[table]["settings"]
    for key in TABLES[table]["rows"]:
      if wanted and key not in wanted:
        continue
      if key in entry["rows"] and not args.force:
        print(f"{table}/{key}: kept (finished {entry['rows'][key]['finished']}); --force to redo", flush=True)
        continue
      steps = args.steps or TABLES[table]["steps"]
      print(f"{table}/{key}: training {steps} steps ...", flush=True)
      row = run_row(table, key, steps, args)
      entry["rows"][key] = row
      save_results(results, args.results)
      render_readme(results, args.readme)
      print(f"{table}/{key}: loss {row['eval_loss']:.4f}, {row['eval_bits_per_byte']:.4f} bits/byte, "
            f"{row['train_tokens_per_sec']:,.0f} tokens/s, {row['seconds']:.0f} s", flush=True)
  render_readme(results, args.readme)
  for table in filter(None, args.tables.split(",")):
    print(f"\n## {table}\n\n" + render_table(table, results["tables"].get(table, {}).get("rows", {})))


if __name__ == "__main__":
  main()
