"""`python -m experiments.paper_tables`: the queue of rows, rendering, benchmarks (see __init__)."""

import argparse
import datetime
import os
import signal
import sys

from experiments.paper_tables.bench import bench_table
from experiments.paper_tables.plots import plot_positions
from experiments.paper_tables.render import render_readme, render_table
from experiments.paper_tables.rows import score_row, score_row_here, train_row
from experiments.paper_tables.specs import (DEFAULT_README, DEFAULT_RESULTS, DEFAULT_STEPS, TABLES,
                                            all_row_keys, queue, split_key)
from experiments.paper_tables.store import load_json, per_position_path, save_compact, save_json


def render_all(results: dict, positions: dict, args) -> None:
  from experiments import verdicts  # pylint: disable=import-outside-toplevel
  loaded = verdicts.load_all(os.path.dirname(os.path.abspath(args.results)))
  decided = verdicts.decide_all(**{**loaded, "paper_tables": results, "positions": positions})
  render_readme(results, positions, args.readme, verdicts=decided)
  for table, spec in TABLES.items():
    if spec["scoring"] == "per_position":
      rows = results["tables"].get(table, {}).get("rows", {})
      plot_positions(table, rows, positions.get(table, {}),
                     os.path.join(os.path.dirname(os.path.abspath(args.results)),
                                  f"paper_tables_{table}_positions.png"))


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tables", default=",".join(TABLES), help="which tables: bcmt, ecp, pi")
  parser.add_argument("--models", default="",
                      help="rows to run: config keys (every seed) or row keys, e.g. bcmt:128,dense@1 "
                      "(default: all)")
  parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps per row")
  parser.add_argument("--seeds", default="",
                      help="these seeds for every row instead of the table's (a registered "
                      "replication, experiments/registered/; give it its own --results)")
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
  seeds = tuple(int(s) for s in args.seeds.split(",") if s) or None
  known = ({k for t in TABLES for k in all_row_keys(t, seeds)}
           | {k for t in TABLES.values() for k, _ in t["rows"]})
  if wanted - known:
    sys.exit(f"error: --models: unknown rows {sorted(wanted - known)}; see TABLES in "
             "experiments/paper_tables/specs.py (row keys are <config key>@<seed>)")
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
  for table, key in queue(tables, seeds):
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
      save_compact(positions, positions_path)
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
