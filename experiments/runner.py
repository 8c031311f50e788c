"""Running an experiment's subprocess: pausable, with its wall clock, paused time and load.

The long experiments (`paper_tables`, `long_range`, `context_ablation`) run each row as a real
`python -m efficient_lm.main` subprocess through `run_monitored`, so a speed measurement can stop
them (`--pause_file`) and their rows record what the machine was doing.
"""

import os
import signal
import statistics
import subprocess
import time

from experiments.common import REPO

def run_monitored(command: list[str], log_path: str, pause_file: str = "", poll_seconds: float = 10.0,
                  say=print) -> dict:
  """Runs `command` (cwd = REPO, output to `log_path`) to its end. Every `poll_seconds` samples the
  1-minute load average and, with `pause_file`, stops the process group while that file exists.

  Returns returncode, wall_seconds, paused_seconds, seconds (wall - paused), the load samples'
  mean / min / max / count, the child's peak RSS (MiB) and CPU seconds (user + system).
  """
  start = time.perf_counter()
  paused = 0.0
  stopped_at = None
  loads: list[float] = []
  next_poll = start
  with open(log_path, "w") as log:
    proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
      while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
          break
        now = time.perf_counter()
        if now >= next_poll:
          next_poll = now + poll_seconds
          wanted = bool(pause_file) and os.path.exists(pause_file)
          if wanted and stopped_at is None:
            os.killpg(proc.pid, signal.SIGSTOP)
            stopped_at = now
            say(f"  paused pid {proc.pid} ({pause_file} exists)", flush=True)
          elif not wanted and stopped_at is not None:
            os.killpg(proc.pid, signal.SIGCONT)
            paused += now - stopped_at
            say(f"  resumed pid {proc.pid} after {now - stopped_at:.0f} s", flush=True)
            stopped_at = None
          if stopped_at is None:
            loads.append(os.getloadavg()[0])
        time.sleep(min(1.0, poll_seconds))
    except BaseException:  # the queue itself stopped: do not leave a stopped or orphaned child
      try:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
      except (OSError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
      raise
  if stopped_at is not None:
    paused += time.perf_counter() - stopped_at
  wall = time.perf_counter() - start
  return {"returncode": os.waitstatus_to_exitcode(status), "wall_seconds": wall,
          "paused_seconds": paused, "seconds": wall - paused,
          "load_mean": statistics.fmean(loads) if loads else float("nan"),
          "load_min": min(loads, default=float("nan")), "load_max": max(loads, default=float("nan")),
          "load_samples": len(loads), "peak_rss_mib": usage.ru_maxrss / 1024,  # Linux: KiB
          "cpu_seconds": usage.ru_utime + usage.ru_stime}


def tail(path: str) -> str:
  with open(path) as f:
    return f.read()[-2000:]
