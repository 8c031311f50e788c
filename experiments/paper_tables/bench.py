"""Side-by-side speed: one `experiments.bench_step` run per table, every model in one process."""

import datetime
import subprocess
import sys

from experiments.common import REPO
from experiments.paper_tables.rows import code_version
from experiments.paper_tables.specs import TABLES, config_arg, quoted


def bench_keys(table: str) -> list[str]:
  """The table's rows that bench_step measures: not the variant rows (`key+variant`), whose
  settings are the row's, which bench_step's --configs cannot carry, and whose config file is
  their base's (measured as that, they would be mislabelled)."""
  return [k for k, _ in TABLES[table]["rows"] if "+" not in k]


def bench_table(table: str, args) -> dict:
  """`python -m experiments.bench_step` over the table's models (`bench_keys`) at its sizes, in
  one process."""
  s = TABLES[table]["settings"]
  keys = bench_keys(table)
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
