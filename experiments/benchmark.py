"""Benchmark harness: train-step tokens/s, memory, FLOPs and MFU against T, for every model; log-log plots.

    nice -n 5 python -m experiments.benchmark                       # d_model 256, 4 layers, T 512..16384
    python -m experiments.benchmark --models=dense,bcmt:128 --seq_lens=1024,4096
    python -m experiments.benchmark --quick --out_dir=/tmp/bench    # tiny sizes, seconds (the test runs it)

Per (model, T), B=1: the train step `efficient_lm.training.loop` runs (forward, backward,
AdamW), compiled once (`experiments.bench_step.compile_train_step`), then the
median wall time of --repeats steps; tokens/s = T / that time. Memory: the
compiled step's temporary buffers (`memory_analysis().temp_size_in_bytes`)
and the process's peak resident set during the timed steps (VmHWM, reset
before each measurement through /proc/self/clear_refs). FLOPs, two counts: the
model's, analytic (`bench_step.model_flops`, `efficient_lm.training.flops`: every
layer, key block and recurrence chunk, no rematerialisation), and what XLA's cost
analysis counts of the compiled step with its layers and the recurrence's state
scan laid out (`bench_step.train_step_flops`; the attention core's key-block loops
and the chunks past `model.seq_chunk` still count once, recomputation counts). MFU:
the model's FLOPs per second over the float32 matrix-multiply peak that the script
measures on the same machine (again at every T, so that a drifting load moves both);
none for the Perceiver-AR family, whose model FLOPs are not counted (its later
layers keep only the latents: `ModelConfig.flops_counted`).

Models are measured T by T (every model at one T, then the next T), so that
the ratios between models at a T hold when the machine's load drifts.

The local sizes follow --block (B): BCMT block B, window and period B, ECP
pieces of B tokens (T / B segments), Perceiver-AR latents 2B and s-Split
segments of B tokens, so the efficient models' cost per token stays constant
as T grows. A model stops growing T once a step takes more than
--max_step_seconds or its compiled temp memory passes --max_memory_gib; the
output says which (dense is the one expected to stop).

Writes <out_dir>/scaling.json (scaling_quick.json with --quick) and log-log
plots <out_dir>/scaling_tokens_per_sec.png, scaling_memory.png.
"""

import argparse
import json
import os
import platform
import statistics
import time
import types

import jax
import jax.numpy as jnp

from experiments import bench_step
from experiments.common import REPO, build, load_config, write_json

MODELS = ("dense,bcmt:128,bcmt:honly128,sliding_window,pi_attention,pi_attention:doubling,ecp,"
          "perceiver_ar,perceiver_ar:compressed,gated_deltanet")


def config_spec(key: str) -> str:
  name, _, preset = key.partition(":")
  return f"configs/{name}.py" + (f":{preset}" if preset else "")


def sized_config(key: str, T: int, args):
  """The model's run at context T with the shared width/depth and the --block local sizes."""
  config = load_config(config_spec(key))
  preset = key.partition(":")[2]
  shared = types.SimpleNamespace(seq_len=T, batch_size=1, vocab_size=args.vocab_size, d_model=args.d_model,
                                 num_layers=args.num_layers, num_heads=args.num_heads, set=[])
  bench_step.apply_settings(config, shared)
  m, block = config.model, args.block
  sizes = {"window": block, "period": block // 2 if preset == "doubling" else block,
           "block_size": block, "num_segments": max(1, T // block), "num_latents": 2 * block,
           "num_history_segments": max(1, (T - 2 * block) // block), "compression": 4}
  for field, value in sizes.items():
    if field in m:
      m[field] = value
  config.train.num_steps = 1000
  return build(config)


def available_memory_gib() -> float:
  """MemAvailable from /proc/meminfo (Linux); 16 GiB where it cannot be read."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) / 2**20
  except OSError:
    pass
  return 16.0


def peak_rss_reset() -> bool:
  """Resets the process's peak RSS (Linux); False where it cannot."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def peak_rss_mib() -> float:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  import resource
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def matmul_peak_flops(n: int, repeats: int) -> float:
  """Float32 matmul FLOP/s on this machine: the fastest of `repeats` n x n x n products (a peak)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  f = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(f(a, b))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(f(a, b))
    times.append(time.perf_counter() - start)
  return 2 * n ** 3 / min(times)


def measure(key: str, T: int, args, peak_flops: float) -> dict:
  config = sized_config(key, T, args)
  start = time.perf_counter()
  compiled, state, batch, memory, _ = bench_step.compile_train_step(config)
  compile_seconds = time.perf_counter() - start
  temp_bytes = getattr(memory, "temp_size_in_bytes", float("nan"))
  model_flops = bench_step.model_flops(config)
  row = {"model": key, "model_name": config.model.name, "seq_len": T, "compile_seconds": compile_seconds,
         "compiled_temp_mib": temp_bytes / 2**20, "model_flops_per_step": model_flops,
         "flops_per_step": bench_step.train_step_flops(config)}
  if temp_bytes > args.max_memory_gib * 2**30:
    row["skipped"] = f"compiled temp memory {temp_bytes / 2**30:.1f} GiB > --max_memory_gib={args.max_memory_gib}"
    return row
  rss_reset = peak_rss_reset()
  times = bench_step.time_steps(compiled, state, batch, args.repeats,
                                give_up_seconds=3 * args.max_step_seconds)
  seconds = statistics.median(times)
  row.update({"step_seconds": seconds, "tokens_per_sec": T / seconds,
              "peak_rss_mib": peak_rss_mib(), "peak_rss_is_per_run": rss_reset,
              "matmul_peak_flops": peak_flops,
              "mfu": None if model_flops is None else model_flops / seconds / peak_flops,
              "repeats": len(times)})
  return row


def plot(rows: list[dict], out_dir: str, suffix: str, title: str) -> list[str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  paths = []
  models = list(dict.fromkeys(r["model"] for r in rows))
  panels = {"tokens_per_sec": [("tokens_per_sec", "train tokens/s")],
            "memory": [("compiled_temp_mib", "compiled temp MiB"), ("peak_rss_mib", "peak RSS MiB")]}
  for name, figures in panels.items():
    fig, axes = plt.subplots(1, len(figures), figsize=(6 * len(figures), 4.5), squeeze=False)
    for ax, (field, label) in zip(axes[0], figures):
      for model in models:
        points = [(r["seq_len"], r[field]) for r in rows if r["model"] == model and field in r]
        if points:
          xs, ys = zip(*points)
          ax.plot(xs, ys, "o-", label=model)
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_xlabel("context T (tokens)")
      ax.set_ylabel(label)
      ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, f"scaling{suffix}_{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths


def plot_title(settings: dict, cpu_count: int, device: str) -> str:
  return (f"train step, B=1, d_model {settings['d_model']}, {settings['num_layers']} layers, vocab "
          f"{settings['vocab_size']}, block/window {settings['block']}; {cpu_count}-CPU {device}")


def markdown(rows: list[dict]) -> str:
  models = list(dict.fromkeys(r["model"] for r in rows))
  rows = sorted(rows, key=lambda r: (models.index(r["model"]), r["seq_len"]))
  lines = ["| model | T | tokens/s | step s | compiled temp MiB | peak RSS MiB | model GFLOP/step | "
           "XLA's GFLOP/step | MFU (model) | note |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  gflop = lambda r, key: f"{r[key] / 1e9:,.1f}" if r.get(key) is not None else "not counted"
  percent = lambda x: "" if x is None else f"{100 * x:.1f}%"
  for r in rows:
    if "step_seconds" in r:
      lines.append(f"| `{r['model']}` | {r['seq_len']} | {r['tokens_per_sec']:,.0f} | {r['step_seconds']:.3f} | "
                   f"{r['compiled_temp_mib']:,.1f} | {r['peak_rss_mib']:,.0f} | "
                   f"{gflop(r, 'model_flops_per_step')} | {gflop(r, 'flops_per_step')} | "
                   f"{percent(r['mfu'])} | |")
    else:
      lines.append(f"| `{r['model']}` | {r['seq_len']} | | | {r.get('compiled_temp_mib', float('nan')):,.1f} | | "
                   f"| | | {r.get('skipped', '')} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", default=MODELS, help="keys such as dense, bcmt:128, pi_attention:doubling")
  parser.add_argument("--seq_lens", default="512,1024,2048,4096,8192,16384")
  parser.add_argument("--d_model", type=int, default=256)
  parser.add_argument("--num_layers", type=int, default=4)
  parser.add_argument("--num_heads", type=int, default=4)
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--block", type=int, default=128, help="block, window, period, ECP piece (tokens)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--max_step_seconds", type=float, default=60.0,
                      help="a model whose step takes longer stops growing T")
  parser.add_argument("--max_memory_gib", type=float, default=0.0,
                      help="skip a (model, T) whose compiled temp memory is larger; 0 = 40%% of the "
                           "memory available at the start (MemAvailable)")
  parser.add_argument("--matmul_size", type=int, default=2048)
  parser.add_argument("--out_dir", default=os.path.join(REPO, "experiments", "results"))
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes (d_model 32, 2 layers, T 128 and 256, block 32): seconds")
  parser.add_argument("--replot", action="store_true",
                      help="only redraw the plots and the table from <out_dir>/scaling[_quick].json "
                           "(adding the model's FLOPs and MFU to rows measured without them)")
  parser.add_argument("--recount_flops", action="store_true",
                      help="with --replot: first recount both FLOPs and MFU of the json's rows (no "
                           "timing; XLA's count lowers every row's step)")
  args = parser.parse_args()
  if args.replot:
    suffix = "_quick" if args.quick else ""
    path = os.path.join(args.out_dir, f"scaling{suffix}.json")
    with open(path) as f:
      result = json.load(f)
    # Rows without the model's FLOPs (measured before it was counted) get it, and their MFU
    # from it: analytic, from the config alone; --recount_flops recounts XLA's too.
    sized = types.SimpleNamespace(**result["settings"])
    counted = False
    for row in result["rows"]:
      if "flops_per_step" in row and (args.recount_flops or "model_flops_per_step" not in row):
        config = sized_config(row["model"], row["seq_len"], sized)
        row["model_flops_per_step"] = bench_step.model_flops(config)
        if args.recount_flops:
          row["flops_per_step"] = bench_step.train_step_flops(config)
        if "step_seconds" in row:
          row["mfu"] = (None if row["model_flops_per_step"] is None else
                        row["model_flops_per_step"] / row["step_seconds"] / row["matmul_peak_flops"])
        counted = True
    if counted:
      with open(path, "w") as f:
        json.dump(result, f, indent=1)
    title = plot_title(result["settings"], result["cpu_count"], result["device"])
    print(markdown(result["rows"]))
    print("wrote", ", ".join(plot(result["rows"], args.out_dir, suffix, title)))
    return
  if args.quick:
    args.d_model, args.num_layers, args.num_heads, args.vocab_size = 32, 2, 2, 512
    args.block, args.repeats, args.matmul_size = 32, 2, 256
    if args.seq_lens == parser.get_default("seq_lens"):
      args.seq_lens = "128,256"
  suffix = "_quick" if args.quick else ""
  os.makedirs(args.out_dir, exist_ok=True)
  if args.max_memory_gib <= 0:
    args.max_memory_gib = round(0.4 * available_memory_gib(), 1)
    print(f"--max_memory_gib={args.max_memory_gib} (40% of the available memory)", flush=True)

  print(f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPUs; matmul peak from {args.matmul_size}^3 "
        "float32 products", flush=True)
  seq_lens = sorted(int(t) for t in args.seq_lens.split(","))
  settings = {k: getattr(args, k) for k in ("d_model", "num_layers", "num_heads", "vocab_size", "block",
                                            "repeats", "max_step_seconds", "max_memory_gib", "quick")}
  settings["batch_size"] = 1
  path = os.path.join(args.out_dir, f"scaling{suffix}.json")
  rows, stopped, peaks = [], {}, {}

  def save() -> None:  # after every measurement: a killed run keeps what it measured
    result = {"settings": settings, "matmul_peak_flops": peaks, "device": jax.devices()[0].device_kind,
              "cpu_count": os.cpu_count(), "platform": platform.platform(),
              "load_average": os.getloadavg(), "rows": rows}
    write_json(path, result)

  # T outer, models inner: every model at one T is measured within minutes of the others, so
  # their ratios hold on a machine whose load drifts over the run.
  for T in seq_lens:
    # The peak is measured again at every T: under a drifting load, MFU is against the peak of the moment.
    peaks[T] = peak = matmul_peak_flops(args.matmul_size, repeats=5)
    print(f"T={T}: float32 matmul peak {peak / 1e9:,.1f} GFLOP/s", flush=True)
    for key in args.models.split(","):
      if key in stopped:
        rows.append({"model": key, "seq_len": T, "skipped": stopped[key]})
        print(f"{key:>26} T={T:>6}: skipped ({stopped[key]})", flush=True)
        continue
      row = measure(key, T, args, peak)
      rows.append(row)
      save()
      if "skipped" in row:
        stopped[key] = row["skipped"]
        print(f"{key:>26} T={T:>6}: skipped ({row['skipped']})", flush=True)
        continue
      mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
      print(f"{key:>26} T={T:>6}: {row['tokens_per_sec']:9,.0f} tokens/s  {row['step_seconds']:8.3f} s/step  "
            f"temp {row['compiled_temp_mib']:9,.1f} MiB  RSS {row['peak_rss_mib']:7,.0f} MiB  "
            f"{row['flops_per_step'] / 1e9:9,.1f} GFLOP (XLA's)  MFU {mfu}", flush=True)
      if row["step_seconds"] > args.max_step_seconds:
        stopped[key] = (f"stopped after T={T}: {row['step_seconds']:.0f} s a step > "
                        f"--max_step_seconds={args.max_step_seconds:g}")
  save()
  plots = plot(rows, args.out_dir, suffix, plot_title(settings, os.cpu_count(), jax.devices()[0].device_kind))
  print("\n" + markdown(rows))
  print(f"\nwrote {path} and {', '.join(plots)}")


if __name__ == "__main__":
  main()
