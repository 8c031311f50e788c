"""Markdown from the rows: a table per comparison and its claims, with the seed-level verdicts."""

import os
import statistics

from experiments.claims import by_claim, verdict_cell
from experiments.paper_tables.metrics import band_loss, curve_of, grouped, metric_values
from experiments.paper_tables.specs import TABLES


def seed_stats(values: list[float]) -> str:
  """'4.4321' for one value; '4.4321 (4.4300-4.4342)': mean (min-max) for several ('to' between
  negative ones)."""
  if len(values) == 1:
    return f"{values[0]:.4f}"
  dash = "-" if min(values) >= 0 else " to "
  return f"{statistics.fmean(values):.4f} ({min(values):.4f}{dash}{max(values):.4f})"


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
  at = lambda v: ",".join(str(v(n)) for n in sorted(steps)) if callable(v) else v  # v(table steps)
  extra = "".join(f"; `{k}`: " + ", ".join(f"{f}={at(v)}" for f, v in s.items())
                  for k, s in spec["row_settings"].items())
  lines.append("")
  lines.append(f"Steps: {', '.join(map(str, sorted(steps)))}. Shared settings: {settings}{extra}. "
               "Cells of several seeds: mean (min-max)."
               + (" Position columns: the per-position validation loss of non-overlapping windows, "
                  "pooled over the windows starting at 0, 1/4, 1/2 and 3/4 of the context into the "
                  "split." if spec["scoring"] == "per_position" else "")
               + " Each row's exact command, seed, wall clock and load are in "
               "`experiments/results/paper_tables.json`.")
  if entry.get("bench"):
    code = entry["bench"].get("code", "")
    code = code[:7] if len(code) == 40 else code  # a commit's hash, or a snapshot's description
    lines.append(f"Side-by-side tokens/s: `{entry['bench']['command']}` (median of "
                 f"{entry['bench']['repeats']} steps, uptime before: {entry['bench']['uptime_before']}"
                 + (f"; the models at {code}, which may be newer than a row's training" if code
                    else "") + ").")
  return "\n".join(lines)


def render_claims(table: str, entry: dict, positions: dict, verdicts: dict | None = None) -> str:
  """The table's claims: each side's per-seed values, the seed-level test and the verdict of the
  whole family (`experiments.verdicts`: Benjamini-Hochberg over every claim, planned seeds)."""
  decided = by_claim(verdicts) if verdicts else {}
  groups = {k: [r for r in rs if "scores" in r] for k, rs in grouped(entry.get("rows", {}), table)}
  lines = ["| claim (lower loss is ahead) | the paper | ours (mean, min-max over seeds) | difference | "
           "seed-level test (p, adjusted p, interval) | verdict |", "| --- | --- | --- | --- | --- | --- |"]
  for text, better, worse, metric, paper, *_ in TABLES[table].get("claims", []):
    a, b = groups.get(better), groups.get(worse)
    va = metric_values(a, metric, positions) if a else None
    vb = metric_values(b, metric, positions) if b else None
    row = decided.get(text)
    if va is None or vb is None or row is None:
      lines.append(f"| {text} | {paper} | (rows not run yet) | | | |")
      continue
    fmt = lambda p: "-" if p is None or p != p else f"{p:.3f}"
    interval = ("" if row["ci_low"] is None or row["ci_low"] != row["ci_low"] else
                f", {'90' if 'margin' in row else '95'}% [{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]")
    detail = f"{row['test']}: p={fmt(row['p_value'])}, adj. {fmt(row['p_adjusted'])}{interval}"
    lines.append(f"| {text} | {paper} | `{better}` {seed_stats(va)} vs `{worse}` {seed_stats(vb)} | "
                 f"{row['difference']:+.4f} | {detail} | {verdict_cell(row)} |")
  return "\n".join(lines)


def render_readme(results: dict, positions: dict, readme: str, verdicts: dict | None = None) -> None:
  """Replaces the text between `<!-- paper_tables:T -->` and `<!-- /paper_tables:T -->` (the
  table) and between the `T_claims` markers (its claims, with `verdicts`: the family's)."""
  if not os.path.exists(readme):
    return
  with open(readme) as f:
    text = f.read()
  for table in TABLES:
    entry, table_positions = results["tables"].get(table, {}), positions.get(table, {})
    for marker, render in ((table, render_table), (f"{table}_claims", render_claims)):
      begin, end = f"<!-- paper_tables:{marker} -->", f"<!-- /paper_tables:{marker} -->"
      if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        body = (render(table, entry, table_positions, verdicts) if render is render_claims
                else render(table, entry, table_positions))
        text = f"{head}{begin}\n{body}\n{end}{tail}"
  with open(readme, "w") as f:
    f.write(text)
