"""Times attention ops, forward + backward, against T: the linear-vs-quadratic check.

    python -m experiments.bench_ops --ops=causal,block_local:256,sliding:256,pi:256:512:4 \
        --seq_lens=2048,4096,16384 --repeats=5 [--baseline_rev=c450ccc] [--memory]

Each op runs jitted on random `[B, T, H, K]` inputs (B=1, H=4, K=64 by default);
the figure is the median wall time of `repeats` calls after compilation. The
table also gives each time over the op's time at the smallest T (linear growth
doubles it per doubling of T) and, at each T, over `causal` at that T.
Measured side by side in one process, so the ratios are meaningful on a noisy
machine even when the absolute times are not. Ops that do not fit (causal at
long T) can be limited with --max_causal_len.

`--interleave` times the ops at each T call by call in turn (one compiled
step each, interleaved like the baseline), so their ratios hold on a loaded
machine; the table's last column is then each op over the first op at that T.
π's wide windows against the sliding window of the same width:

    nice -n 5 python -m experiments.bench_ops --ops=sliding:8192,pi:8192:16384:3 \
        --seq_lens=65536 --repeats=2 --interleave --json=experiments/results/ops_pi_wide.json

`--baseline_rev=REV` also times `efficient_lm/ops` as it was at git revision
REV (extracted with `git show` into a temporary package), interleaved call by
call with the current ops, and reports current / baseline. `--memory` compiles
only and reports the compiled fwd+bwd temporary bytes (`memory_analysis()`),
total and per token.

Op specs: 'causal' (impl flash), 'causal_ref' (the dense reference einsum),
'block_local:L[:lookback]', 'sliding:W', 'pi:W:P:S'.
"""

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from efficient_lm.ops import attention

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_baseline(rev: str):
  """The `attention` module of `efficient_lm/ops` at git revision `rev`, under another package name."""
  git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True,
                                  check=True).stdout
  package = "baseline_ops_" + "".join(c if c.isalnum() else "_" for c in rev)
  root = tempfile.mkdtemp(prefix="bench_ops_")
  os.makedirs(os.path.join(root, package))
  for path in git("ls-tree", "-r", "--name-only", rev, "efficient_lm/ops/").split():
    if path.endswith(".py"):  # subpackages (ops/core) too
      source = git("show", f"{rev}:{path}").replace("efficient_lm.ops", package)
      target = os.path.join(root, package, os.path.relpath(path, "efficient_lm/ops"))
      os.makedirs(os.path.dirname(target), exist_ok=True)
      with open(target, "w", encoding="utf-8") as f:
        f.write(source)
  sys.path.insert(0, root)
  return importlib.import_module(f"{package}.attention")


def make_op(spec: str, module=attention):
  """An op spec (see the module docstring) -> f(q, k, v) from `module`."""
  name, *args = spec.split(":")
  nums = [int(a) for a in args]
  if name == "causal":
    return module.causal_attention
  if name == "causal_ref":
    return lambda q, k, v: module.causal_attention(q, k, v, impl="reference")
  if name == "block_local":
    return lambda q, k, v: module.block_local_attention(
        q, k, v, block_size=nums[0], lookback=nums[1] if len(nums) > 1 else 0)
  if name == "sliding":
    return lambda q, k, v: module.sliding_window_attention(q, k, v, window=nums[0])
  if name == "pi":
    def pi(q, k, v):
      gate = jnp.full(q.shape[:3], 0.5, q.dtype)
      return module.pi_attention(q, k, v, gate, window=nums[0], period=nums[1], num_skips=nums[2])
    return pi
  raise ValueError(f"unknown op spec {spec!r}")


def inputs(T: int, *, batch: int, heads: int, head_dim: int, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(0), 3)
  return [jax.random.normal(key, (batch, T, heads, head_dim), dtype) for key in keys]


def fwd_bwd(op):
  return jax.jit(jax.grad(lambda q, k, v: jnp.sum(op(q, k, v) ** 2), argnums=(0, 1, 2)))


def compiled_temp_bytes(op, T: int, *, batch: int, heads: int, head_dim: int) -> int:
  shape = jax.ShapeDtypeStruct((batch, T, heads, head_dim), jnp.float32)
  compiled = fwd_bwd(op).lower(shape, shape, shape).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def time_calls(steps: list, args, repeats: int) -> list[float]:
  """Median seconds of each compiled step, called in turn (interleaved) `repeats` times."""
  for step in steps:
    jax.block_until_ready(step(*args))  # compile
  times = [[] for _ in steps]
  for _ in range(repeats):
    for step, out in zip(steps, times):
      start = time.perf_counter()
      jax.block_until_ready(step(*args))
      out.append(time.perf_counter() - start)
  return [statistics.median(t) for t in times]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--ops", default="causal,block_local:256,sliding:256,pi:256:512:4")
  parser.add_argument("--seq_lens", default="2048,4096,16384")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--max_causal_len", type=int, default=8192)
  parser.add_argument("--baseline_rev", default="",
                      help="also time efficient_lm/ops at this git revision, interleaved")
  parser.add_argument("--memory", action="store_true",
                      help="compile only; report fwd+bwd temporary bytes")
  parser.add_argument("--json", default="", help="also write the results to this file")
  parser.add_argument("--interleave", action="store_true",
                      help="time the ops at each T call by call in turn (ratios to the first op)")
  args = parser.parse_args()
  specs = args.ops.split(",")
  seq_lens = [int(t) for t in args.seq_lens.split(",")]
  shape = dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim)
  baseline = load_baseline(args.baseline_rev) if args.baseline_rev else None
  print(f"uptime: {os.getloadavg()} (1, 5, 15 min load averages)", flush=True)

  if args.memory:
    rows = []
    print("| op | T | temp MiB | bytes / token |\n| --- | --- | --- | --- |")
    for spec in specs:
      for T in seq_lens:
        temp = compiled_temp_bytes(make_op(spec), T, **shape)
        rows.append({"op": spec, "seq_len": T, "temp_bytes": temp})
        print(f"| {spec} | {T} | {temp / 2**20:,.1f} | {temp / T:,.0f} |", flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    return

  results, base_results = {}, {}
  if args.interleave:
    for T in seq_lens:
      times = time_calls([fwd_bwd(make_op(spec)) for spec in specs], inputs(T, **shape),
                         args.repeats)
      for spec, seconds in zip(specs, times):
        results[(spec, T)] = seconds
        print(f"{spec:>20} T={T:>6}: {1e3 * seconds:9.1f} ms   / {specs[0]} "
              f"{seconds / times[0]:.3f}", flush=True)
    specs = []  # timed
  for spec in specs:
    for T in seq_lens:
      if spec.startswith("causal") and T > args.max_causal_len:
        continue
      steps = [fwd_bwd(make_op(spec))]
      if baseline is not None and spec != "causal_ref":
        steps.append(fwd_bwd(make_op(spec, baseline)))
      times = time_calls(steps, inputs(T, **shape), args.repeats)
      results[(spec, T)] = times[0]
      line = f"{spec:>20} T={T:>6}: {1e3 * times[0]:9.1f} ms"
      if len(times) > 1:
        base_results[(spec, T)] = times[1]
        line += f"   baseline {1e3 * times[1]:9.1f} ms   current / baseline {times[0] / times[1]:.3f}"
      print(line, flush=True)
  print(f"\nfwd+bwd median of {args.repeats}, B={args.batch} H={args.heads} K={args.head_dim}"
        + (f"; baseline = efficient_lm/ops at {args.baseline_rev}" if baseline else "") + "\n")
  print("| op | T | ms | vs T=" + str(seq_lens[0]) + " | causal / op |"
        + (" baseline ms | baseline vs T=" + str(seq_lens[0]) + " | current / baseline |"
           if baseline else ""))
  print("| --- | --- | --- | --- | --- |" + (" --- | --- | --- |" if baseline else ""))
  for (spec, T), seconds in results.items():
    base = results.get((spec, seq_lens[0]))
    causal = results.get(("causal", T))
    line = (f"| {spec} | {T} | {1e3 * seconds:.1f} | {seconds / base:.2f} | "
            f"{'' if causal is None else f'{causal / seconds:.2f}'} |")
    if baseline:
      old, old_first = base_results.get((spec, T)), base_results.get((spec, seq_lens[0]))
      line += ("   |   |   |" if old is None else
               f" {1e3 * old:.1f} | {old / old_first:.2f} | {seconds / old:.3f} |")
    print(line)
  print(f"\nuptime: {os.getloadavg()}")
  if args.json:
    with open(args.json, "w") as f:
      first = args.ops.split(",")[0]
      json.dump([{"op": s, "seq_len": T, "seconds": v, "baseline_seconds": base_results.get((s, T)),
                  **({"over_first_op": v / results[(first, T)], "interleaved": True,
                      "command": "python -m experiments.bench_ops " + " ".join(sys.argv[1:]),
                      "load_average": os.getloadavg()} if args.interleave else {})}
                 for (s, T), v in results.items()], f, indent=1)


if __name__ == "__main__":
  main()
