"""The first hour of a new user, measured: stops in every phase, progress, refusals, stdout, errors.

    nice python -m experiments.first_hour --out=experiments/results/first_hour.json

Every case runs the entry point as a user does (`python -m efficient_lm.main ...` in a
subprocess) and times it from outside, with real signals:

- `stops`: a fresh data directory (pip's cache off, so the corpus is really downloaded), the
  default config at `--steps` steps, jax's compilation cache off. SIGINT during the download,
  SIGTERM during the tokenizer's training, SIGINT while tokenizing, each in a rerun of the same
  command; then the command runs to the end. With the data prepared, SIGINT and SIGTERM during
  the compile, then the command completes. Each stop: seconds from the signal to the exit, the status, the stop line, and the
  temporary files left in the data directory (none expected).
- `default`: the default command (`--config=configs/pi_attention.py`) in a fresh workdir with the
  user's data cache: seconds to the first line and to the first training line, the longest
  silence after that, the wall time, the final result, and every stdout line (the run's own
  JSON only, expected).
- `refusal`: the workdir `default` trained, rerun with `configs/dense.py` (refused: another
  model), timed against `--compile_only` of that dense config (with jax's compilation cache warm,
  and off).
- `errors`: a misspelled config field and an unknown flag, seconds to the one-line answer.
- `one_minute`: the default command at `--one_minute_steps` steps, fresh workdir, warm cache.
- `fresh`: the same in a fresh data directory (pip's cache off): what the very first run costs,
  the corpus downloaded and prepared, a tokenizer trained, the splits tokenized.

While it runs, `--pause_file` pauses the background experiments that watch it.
"""

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from experiments.common import REPO, paused

TEMPORARY = (".tmp", ".part", ".incomplete", ".pip.", ".write_test", "tmp")
CHATTER = ("Downloading and preparing", "dataset_info.json", "Gloo", "WARNING: All log messages",
           "absl::InitializeLog")


class Run:
  """`python -m efficient_lm.main ARGS`, its stdout and stderr lines with their times (seconds
  from the start)."""

  def __init__(self, args: list[str], env: dict | None = None):
    self.start = time.perf_counter()
    self.process = subprocess.Popen([sys.executable, "-m", "efficient_lm.main", *args], cwd=REPO,
                                    env={**os.environ, **(env or {})}, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    self.stdout: list[tuple[float, str]] = []
    self.stderr: list[tuple[float, str]] = []
    self.readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                    for stream, lines in ((self.process.stdout, self.stdout),
                                          (self.process.stderr, self.stderr))]
    for reader in self.readers:
      reader.start()

  def _read(self, stream, lines):
    for line in stream:
      lines.append((time.perf_counter() - self.start, line.rstrip("\n")))

  def wait_for(self, text: str, timeout: float) -> float | None:
    """Seconds at which a stderr line containing `text` came (None: the process ended, or
    `timeout` passed, first)."""
    deadline = time.perf_counter() + timeout
    seen = 0
    while time.perf_counter() < deadline:
      for when, line in self.stderr[seen:]:
        if text in line:
          return when
      seen = len(self.stderr)
      if self.process.poll() is not None:
        return None
      time.sleep(0.05)
    return None

  def finish(self, timeout: float = 3600) -> float:
    self.process.wait(timeout=timeout)
    for reader in self.readers:
      reader.join()
    return time.perf_counter() - self.start

  def now(self) -> float:
    return time.perf_counter() - self.start


def leftovers(folder: str) -> list[str]:
  found = []
  for root, dirs, files in os.walk(folder):
    found += [os.path.relpath(os.path.join(root, n), folder) for n in dirs + files
              if any(mark in n for mark in TEMPORARY)]
  return found


def stop_lines(run: Run) -> list[str]:
  return [line for _, line in run.stderr if line.startswith(("stopped by", "error:"))]


def stop_case(args, env, data_dir, phase_text, delay, sig) -> dict:
  """Starts the command, sends `sig` `delay` s after a stderr line containing `phase_text`."""
  run = Run(args, env)
  seen = run.wait_for(phase_text, timeout=1800)
  row = {"phase": phase_text, "signal": signal.Signals(sig).name, "phase_seen_at_s": seen}
  if seen is None:
    run.finish()
    row.update(error="the phase never came (or the command ended first)",
               status=run.process.returncode, stderr_tail=[line for _, line in run.stderr[-5:]])
    print(f"  {phase_text!r}: never came; status {row['status']}", flush=True)
    return row
  time.sleep(delay)
  sent = run.now()
  run.process.send_signal(sig)
  end = run.finish(timeout=600)
  row.update(signal_at_s=round(sent, 2), exit_after_signal_s=round(end - sent, 2),
             status=run.process.returncode, stop_lines=stop_lines(run),
             stdout=[line for _, line in run.stdout], leftovers=leftovers(data_dir))
  print(f"  {row['signal']} during {phase_text!r}: status {row['status']} "
        f"{row['exit_after_signal_s']} s after the signal; {row['stop_lines']}", flush=True)
  return row


def complete(args, env, data_dir) -> dict:
  run = Run(args, env)
  wall = run.finish()
  row = {"status": run.process.returncode, "wall_s": round(wall, 1),
         "stdout": [line for _, line in run.stdout], "leftovers": leftovers(data_dir)}
  print(f"  rerun: status {row['status']} in {row['wall_s']} s", flush=True)
  return row


def stops(tmp: str, steps: int) -> dict:
  data_dir = os.path.join(tmp, "data")
  args = ["--config=configs/pi_attention.py", f"--workdir={tmp}/stops", f"--config.data.data_dir={data_dir}",
          f"--config.train.num_steps={steps}", "--config.train.sample_tokens=0",
          "--config.train.compilation_cache_dir="]  # every compile a real one
  env = {"PIP_NO_CACHE_DIR": "1"}
  out = {"command": "python -m efficient_lm.main " + " ".join(args), "env": env, "cases": []}
  for text, delay, sig in (("downloading", 0.5, signal.SIGINT),
                           ("Training a", 2.0, signal.SIGTERM),           # the tokenizer
                           ("Trained tokenizer", 0.3, signal.SIGINT)):    # then tokenizing
    out["cases"].append(stop_case(args, env, data_dir, text, delay, sig))
    out["cases"][-1]["workdir_left"] = os.path.exists(f"{tmp}/stops")
  out["rerun_after_preparation_stops"] = complete(args, env, data_dir)
  for sig in (signal.SIGINT, signal.SIGTERM):
    subprocess.run(["rm", "-rf", f"{tmp}/stops"], check=True)
    out["cases"].append(stop_case(args, env, data_dir, "compiling the train step", 1.0, sig))
    out["cases"][-1]["workdir_left"] = os.path.exists(f"{tmp}/stops")
  out["rerun_after_compile_stops"] = complete(args, env, data_dir)
  return out


def timeline(run: Run) -> dict:
  """First line, first training line, the longest gap between stderr lines after the first."""
  times = [t for t, _ in run.stderr]
  training = [t for t, line in run.stderr if re.search(r"\bstep \d+/\d+ ", line)]
  gaps = [b - a for a, b in zip(times, times[1:])]
  return {"first_line_s": round(times[0], 2) if times else None,
          "first_training_line_s": round(training[0], 1) if training else None,
          "training_lines": len(training),
          "longest_silence_s": round(max(gaps), 1) if gaps else None,
          "longest_silence_after": next((line for (t, line), g in zip(run.stderr, gaps)
                                         if g == max(gaps)), None) if gaps else None}


def default_run(tmp: str, extra: list[str], env: dict | None = None) -> dict:
  args = ["--config=configs/pi_attention.py", f"--workdir={tmp}/default", *extra]
  run = Run(args, env)
  wall = run.finish()
  stdout = [line for _, line in run.stdout]
  result = {"command": "python -m efficient_lm.main " + " ".join(args), "status": run.process.returncode,
            "wall_s": round(wall, 1), **timeline(run), "stdout": stdout,
            "stdout_all_json": all(_is_json(line) for line in stdout),
            "chatter_on_stderr": [line for _, line in run.stderr if any(c in line for c in CHATTER)],
            "prepared_data": any("tokenizing" in line or "downloading" in line for _, line in run.stderr),
            "stderr_head": [line for _, line in run.stderr[:6]],
            "training_lines_head": [line for _, line in run.stderr
                                    if re.search(r"\bstep \d+/\d+ ", line)][:3],
            "stderr_tail": [line for _, line in run.stderr[-4:]],
            **({"env": env, "_stderr": run.stderr} if env else {})}
  print(f"  {result['command']}: status {result['status']} in {result['wall_s']} s; first training "
        f"line at {result['first_training_line_s']} s, longest silence {result['longest_silence_s']} s",
        flush=True)
  return result


def preparation_seconds(stderr: list[tuple[float, str]]) -> float | None:
  """Seconds from the start to the corpus being ready (its `Corpus(...)` line)."""
  return next((round(t, 1) for t, line in stderr if "Corpus(" in line), None)


def _is_json(line: str) -> bool:
  try:
    json.loads(line)
    return True
  except ValueError:
    return False


def timed(args: list[str]) -> dict:
  run = Run(args)
  wall = run.finish()
  return {"command": "python -m efficient_lm.main " + " ".join(args), "status": run.process.returncode,
          "wall_s": round(wall, 2),
          "lines": [line for _, line in run.stderr if line.startswith(("error:", "stopped"))]
          or [line for _, line in run.stderr][-2:]}


def refusal(tmp: str, repeats: int) -> dict:
  refused = [timed(["--config=configs/dense.py", f"--workdir={tmp}/default"]) for _ in range(repeats)]
  compiled = [timed(["--config=configs/dense.py", "--compile_only"]) for _ in range(repeats)]
  cold = [timed(["--config=configs/dense.py", "--compile_only", "--config.train.compilation_cache_dir="])
          for _ in range(repeats)]
  median = lambda rows: statistics.median(r["wall_s"] for r in rows)
  out = {"refused": refused, "compile_only": compiled, "compile_only_no_cache": cold,
         "refused_median_s": median(refused), "compile_only_median_s": median(compiled),
         "compile_only_no_cache_median_s": median(cold),
         "ratio": round(median(refused) / median(compiled), 3),
         "ratio_no_cache": round(median(refused) / median(cold), 3)}
  print(f"  refusal {out['refused_median_s']} s, --compile_only {out['compile_only_median_s']} s "
        f"(warm compilation cache; {out['compile_only_no_cache_median_s']} s without): ratio "
        f"{out['ratio']} ({out['ratio_no_cache']})", flush=True)
  return out


def errors(repeats: int) -> dict:
  out = {}
  for name, args in (("misspelled_field", ["--config=configs/pi_attention.py", "--config.train.num_stepz=5"]),
                     ("unknown_flag", ["--config=configs/pi_attention.py", "--num_steps=5"])):
    rows = [timed(args) for _ in range(repeats)]
    out[name] = {"rows": rows, "median_s": statistics.median(r["wall_s"] for r in rows)}
    print(f"  {name}: {out[name]['median_s']} s, {rows[0]['lines']}", flush=True)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--parts", default="errors,stops,default,refusal,one_minute,fresh")
  parser.add_argument("--steps", type=int, default=20, help="train steps of the `stops` command")
  parser.add_argument("--one_minute_steps", type=int, default=50)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default="experiments/results/first_hour.json")
  parser.add_argument("--pause_file", default="/tmp/efficient_lm_quiet")
  args = parser.parse_args()
  parts = args.parts.split(",")
  result = {}
  if os.path.exists(args.out):
    with open(args.out) as f:
      result = json.load(f)  # additive: parts measured before are kept unless measured again
  result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "load_average_at_start": os.getloadavg()}
  with tempfile.TemporaryDirectory() as tmp, paused(args.pause_file, "first_hour"):
    for part in ("errors", "stops", "default", "refusal", "one_minute", "fresh"):
      if part not in parts:
        continue
      print(f"{part}:", flush=True)
      if part == "errors":
        result[part] = errors(args.repeats)
      elif part == "stops":
        result[part] = stops(tmp, args.steps)
      elif part == "default":
        result[part] = default_run(tmp, [])
      elif part == "refusal":
        if not os.path.isdir(f"{tmp}/default"):
          default_run(tmp, ["--config.train.num_steps=2", "--config.train.sample_tokens=0"])
        result[part] = refusal(tmp, args.repeats)
      elif part == "one_minute":
        result[part] = default_run(f"{tmp}/one", [f"--config.train.num_steps={args.one_minute_steps}"])
      elif part == "fresh":
        result[part] = default_run(f"{tmp}/fresh", [f"--config.train.num_steps={args.one_minute_steps}",
                                                    f"--config.data.data_dir={tmp}/fresh_data"],
                                   env={"PIP_NO_CACHE_DIR": "1"})
        result[part]["preparation_s"] = preparation_seconds(result[part].pop("_stderr"))
      result[part]["measured"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
      os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
      with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
