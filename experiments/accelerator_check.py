"""The device check: on a lent GPU or TPU, in one short run, with only what the device has.

    bash experiments/accelerator_check.sh     # what a device runs (docs/accelerators.md)
    ACCELERATOR_CHECK_PLATFORM=cpu bash experiments/accelerator_check.sh   # the whole path, tiny, on CPU

Steps, each written as it completes (the JSON file is rewritten whole, atomically, after every
row, so a run cut short keeps what finished; `status` stays "running" then):

1. versions: Python, jax, jaxlib, the accelerator plugins, and the private jax features this
   jax lacks (`efficient_lm.runtime.jax_compat.report_line`), in one line.
2. the device: the first of cuda, rocm, tpu that jax starts (`--platform` / the environment's
   ACCELERATOR_CHECK_PLATFORM picks one, `cpu` included).
3. backends (`accelerator_backends.backend_rows`), then cudnn (`cudnn_rows`; on CPU also
   `cudnn_aot_rows`): against a float32 reference.
4. train steps: every model at each T (`--seq_lens`), each in its own process
   (`experiments/accelerator_step.py`), so each peak is that step's alone; ascending T, what
   does not fit in `--budget_seconds` is skipped (said so in the row and the last line).

This process never starts a jax backend (a TPU is held by one process at a time): steps 2 and 3
run in a child (`--part=attention`) that prints `DEVICE {json}` and `ROW <section> {json}` lines
(or one `FAIL ...` / `NONE ...` line), which this process writes into the JSON as they come.

Exit status: 0 all passed, or no accelerator (jax itself reports none and none is visible);
1 a row failed (a backend off the reference, cuDNN not serving, a model that does not compile
or run); 2 jax or the library cannot start, or a visible GPU / TPU that jax does not start.
Failures end in one line `accelerator_check: FAIL: ...`.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from experiments.accelerator_step import MODELS, peak_tflops

EXIT_FAILED, EXIT_CANNOT_START = 1, 2
ACCELERATORS = ("cuda", "rocm", "tpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CannotStart(Exception):
  """jax or the library cannot start (the message is one line)."""


def one_line(error: BaseException) -> str:
  text = str(error).strip()
  return f"{type(error).__name__}: {text.splitlines()[0][:300]}" if text else type(error).__name__


class Summary:
  """The JSON summary at `path`: sections of rows, rewritten whole after every change (a temp
  file flushed and renamed over it), so the file is always complete JSON."""

  def __init__(self, path: str, **fields):
    self.path = path
    self.data = {"status": "running", **fields}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self.write()

  def set(self, **fields) -> None:
    self.data.update(fields)
    self.write()

  def add(self, section: str, row: dict) -> None:
    self.data.setdefault(section, []).append(row)
    self.write()

  def write(self) -> None:
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(self.data, f, indent=1)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.path)


def visible_hardware() -> list[str]:
  """Device files of GPUs / TPUs this machine shows, whatever jax says."""
  found = []
  for folder, prefix in (("/dev", "nvidia"), ("/dev", "accel"), ("/dev", "kfd")):
    try:
      names = os.listdir(folder)
    except OSError:
      continue
    found += [os.path.join(folder, n) for n in sorted(names)
              if n.startswith(prefix) and (prefix != "nvidia" or n[len(prefix):].isdigit())]
  return found


def start(platform: str | None):
  """(jax, device): jax imported, the library importable, the device found. CannotStart when
  jax or the library cannot start or a visible accelerator has no jax backend; (jax, None)
  when jax reports no accelerator and none is visible."""
  if platform == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
  try:
    import jax  # pylint: disable=import-outside-toplevel
  except Exception as error:  # pylint: disable=broad-except
    raise CannotStart(f"jax cannot be imported by {sys.executable}: {one_line(error)}") from None
  try:
    import efficient_lm.models  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import efficient_lm.training.step_memory  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    from experiments import accelerator_backends  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except Exception as error:  # pylint: disable=broad-except
    raise CannotStart(f"the library cannot be imported: {one_line(error)}") from None
  if platform == "cpu":
    return jax, jax.devices("cpu")[0]
  errors = {}
  for name in ([{"gpu": "cuda"}.get(platform, platform)] if platform else ACCELERATORS):
    try:
      return jax, jax.devices(name)[0]
    except RuntimeError as error:
      errors[name] = one_line(error)
  why = "; ".join(f"{k}: {v}" for k, v in errors.items())
  if platform:
    raise CannotStart(f"platform {platform} asked for, but jax starts no {platform} backend ({why})")
  hardware = visible_hardware()
  if hardware:
    raise CannotStart(f"{', '.join(hardware)} present but jax starts no accelerator backend ({why})")
  return jax, None


def run_step(name: str, T: int, args, deadline: float) -> dict:
  """One train step row from its own process (`accelerator_step`), or a skip / error row."""
  left = deadline - time.time()
  if left < 20:
    return {"model": name, "seq_len": T, "skipped": "out of time"}
  command = [sys.executable, "-m", "experiments.accelerator_step", f"--model={name}",
             f"--seq_len={T}", f"--d_model={args.d_model}", f"--num_layers={args.num_layers}",
             f"--num_heads={args.num_heads}", f"--vocab_size={args.vocab_size}",
             f"--repeats={args.repeats}"]
  start_time = time.perf_counter()
  try:
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=left)
  except subprocess.TimeoutExpired:
    return {"model": name, "seq_len": T, "skipped": f"out of time (stopped after {left:.0f} s)"}
  rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
  if rows:
    row = json.loads(rows[-1])
  else:
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
    row = {"model": name, "seq_len": T, "error": f"its process exited with {done.returncode}: {tail}"}
  if "error" in row:
    sys.stderr.write(done.stderr[-3000:])
  row["process_seconds"] = time.perf_counter() - start_time
  return row


def describe_step(r: dict) -> str:
  if "tokens_per_sec" in r and "error" not in r:
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"
    mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.1%}"
    return (f"{r['tokens_per_sec']:,.0f} tokens/s, MFU {mfu}, estimate {gib(r['estimate_bytes'])},"
            f" peak {gib(r['peak_bytes_in_use'])}, kernels {r['attention_kernels']}")
  return r.get("error") or r.get("skipped", "")


def attention_part(args) -> int:
  """Steps 2 and 3 in this (child) process: `DEVICE` / `ROW` lines, or one `FAIL` / `NONE` line."""
  say = lambda line: print(line, flush=True)
  try:
    jax, device = start(args.platform)
  except CannotStart as error:
    say(f"FAIL {error}")
    return EXIT_CANNOT_START
  if device is None:
    say(f"NONE jax devices: {', '.join(sorted({d.platform for d in jax.devices()}))}")
    return 0
  from efficient_lm.parallel import targets  # pylint: disable=import-outside-toplevel
  from experiments import accelerator_backends  # pylint: disable=import-outside-toplevel
  platform = targets.platform_of([device])
  say("DEVICE " + json.dumps({"device": device.device_kind, "platform": platform}))
  if args.steps_only:
    return 0
  emit = lambda section: lambda row: say(f"ROW {section} {json.dumps(row)}")
  quick = platform == "cpu"
  accelerator_backends.backend_rows(platform, quick, emit("backends"))
  accelerator_backends.cudnn_rows(platform, quick, emit("cudnn"))
  if quick:
    accelerator_backends.cudnn_aot_rows(quick, emit("cudnn_aot"))
  return 0


def attention_lines(args, timeout: float):
  """The stdout lines of the attention part's process as they come (its stderr passes through),
  then one `EXIT <status>` line; killed after `timeout` seconds (`EXIT timeout`)."""
  command = [sys.executable, "-m", "experiments.accelerator_check", "--part=attention"]
  command += [f"--platform={args.platform}"] if args.platform else []
  command += ["--steps_only"] if args.steps_only else []
  process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
  killed = threading.Event()

  def kill():
    killed.set()
    process.kill()

  timer = threading.Timer(max(timeout, 1.0), kill)
  timer.start()
  try:
    for line in process.stdout:
      yield line.rstrip("\n")
    status = process.wait()
  finally:
    timer.cancel()
    if process.poll() is None:  # the caller stopped reading
      process.kill()
      process.wait()
  yield "EXIT timeout" if killed.is_set() else f"EXIT {status}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--platform", default=os.environ.get("ACCELERATOR_CHECK_PLATFORM") or None,
                      choices=["cpu", "gpu", "cuda", "rocm", "tpu"],
                      help="default: the first accelerator jax starts; cpu: the whole path, tiny")
  parser.add_argument("--out", default=os.path.join(os.environ.get("OUT") or
                                                    os.path.join(REPO, "runs", "accelerator_check"),
                                                    "accelerator_check.json"))
  parser.add_argument("--seq_lens", default="4096,32768,131072")
  parser.add_argument("--d_model", type=int, default=1024)
  parser.add_argument("--num_layers", type=int, default=4)
  parser.add_argument("--num_heads", type=int, default=8)
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--budget_seconds", type=float, default=float(
      os.environ.get("ACCELERATOR_CHECK_BUDGET", 470)))
  parser.add_argument("--steps_only", action="store_true",
                      help="skip the attention rows (a second run for train steps skipped for time)")
  parser.add_argument("--part", choices=["attention"], help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.part == "attention":
    return attention_part(args)
  began = time.time()
  if args.platform == "cpu":  # the whole path at tiny sizes
    args.seq_lens, args.d_model, args.num_layers, args.num_heads = "256", 64, 2, 2
    args.vocab_size, args.repeats = 512, 1
  say = lambda line: print(line, flush=True)
  try:  # jax imports here, but no backend starts in this process
    import jax  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except Exception as error:  # pylint: disable=broad-except
    say(f"accelerator_check: FAIL: jax cannot be imported by {sys.executable}: {one_line(error)}")
    return EXIT_CANNOT_START
  from efficient_lm.runtime import jax_compat  # pylint: disable=import-outside-toplevel
  versions = jax_compat.report()
  say(f"accelerator_check: {jax_compat.report_line(versions)}")
  summary, failures = None, []
  deadline = began + args.budget_seconds
  short = lambda r: {k: r[k] for k in ("o", "lse", "grads") if k in r}
  errors = lambda r: " ".join(f"{k} {v:.1e}" for k, v in short(r).items())
  describe = {
      "backends": lambda r: f"{r['pattern']} {r['impl']} {r['dtype']} {r['shape']}: {errors(r)}",
      "cudnn": lambda r: f"{r['call']} {r['shape']} on {r['path']}: {errors(r)} {r.get('kernels', '')}",
      "cudnn_aot": lambda r: f"{r['call']} {r.get('shape', '')} for {r['aot']}: "
                             f"{r.get('kernels', r.get('skipped', ''))}"}
  for line in attention_lines(args, deadline - time.time()):
    kind, _, rest = line.partition(" ")
    if kind == "FAIL":
      say(f"accelerator_check: FAIL: {rest}")
      return EXIT_CANNOT_START
    if kind == "NONE":
      say(f"accelerator_check: no GPU or TPU here ({rest}); nothing to check.")
      return 0
    if kind == "DEVICE":
      found = json.loads(rest)
      summary = Summary(args.out, versions=versions, **found, command=" ".join(
          [os.path.basename(sys.executable), "-m", "experiments.accelerator_check",
           *(argv if argv is not None else sys.argv[1:])]), settings={
               k: getattr(args, k) for k in ("seq_lens", "d_model", "num_layers", "num_heads",
                                             "vocab_size", "repeats", "budget_seconds")})
      peak = peak_tflops(found["device"])
      say(f"accelerator_check: {found['device']} ({found['platform']}), peak bf16 "
          f"{'unknown' if peak is None else f'{peak:.0f} TFLOP/s'}; rows in {args.out}")
    elif kind == "ROW" and summary is not None:
      section, _, text = rest.partition(" ")
      row = json.loads(text)
      summary.add(section, row)
      say(f"  {section}: {describe[section](row)}"
          + ("" if row["ok"] else "  FAIL: " + "; ".join(row["problems"])))
      if not row["ok"]:
        failures.append(f"{section} {describe[section](row)}: {'; '.join(row['problems'])}")
    elif kind == "EXIT" and rest != "0":
      why = "stopped: out of time" if rest == "timeout" else f"process exited with {rest}"
      if summary is None:
        say(f"accelerator_check: FAIL: the attention checks' {why} before naming a device")
        return EXIT_CANNOT_START
      failures.append(f"the attention checks' {why}")
    elif kind != "EXIT":
      say(line)
  if summary is None:
    say("accelerator_check: FAIL: the attention checks named no device")
    return EXIT_CANNOT_START
  steps = []
  for T in sorted(map(int, args.seq_lens.split(","))):
    for name in MODELS:
      row = run_step(name, T, args, deadline)
      steps.append(row)
      summary.add("train_steps", row)
      say(f"  train step {name} T={T}: {describe_step(row)}")
      if "error" in row:
        failures.append(f"train step {name} T={T}: {row['error']}")
  dense = {r["seq_len"]: r.get("tokens_per_sec") for r in steps if r["model"] == "dense"}
  for r in steps:
    if r.get("tokens_per_sec") and dense.get(r["seq_len"]) and r["model"] != "dense":
      r["vs_dense"] = r["tokens_per_sec"] / dense[r["seq_len"]]
  skipped = sum("skipped" in r for r in steps)
  summary.set(status="failed" if failures else "passed", failures=failures, skipped=skipped,
              seconds=time.time() - began)
  if failures:
    say(f"accelerator_check: FAIL: {len(failures)} failed: {failures[0]}"
        + (f" (and {len(failures) - 1} more in {args.out})" if len(failures) > 1 else ""))
    return EXIT_FAILED
  say(f"accelerator_check: passed in {time.time() - began:.0f} s: "
      f"{len(summary.data.get('backends', []))} backend rows, {len(summary.data.get('cudnn', []))}"
      f" cuDNN rows, {len(steps) - skipped} of {len(steps)} train steps"
      + (f" ({skipped} skipped for time)" if skipped else "") + f"; {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
