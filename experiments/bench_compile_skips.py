"""Compile time and program size of π's periodic skips: window alone vs window + 62 skips.

    touch /tmp/efficient_lm_quiet; nice -n 5 python -m experiments.bench_compile_skips \
        --json=experiments/results/compile_skips.json; rm -f /tmp/efficient_lm_quiet

At T = 1,024: a causal window of 32 alone (`Pattern.sliding(32)`) against the same window with
the skips 16 m, m = 2..63 (`Pattern.pi(32, 16, 63, seq_len=1024)`: 62 skips, the skip prior
on), on the XLA core (`core.attend`, forward + backward of a random cotangent) and in the π
model's train step (`configs/pi_attention.py` at d_model 64, 2 layers, 2 heads, vocabulary 256,
batch 1; `model.num_skips` 0 vs 63). Reported per program: compile seconds (`lower().compile()`,
the median of --repeats fresh compiles with `jax.clear_caches()` between), and the line counts
of the lowered StableHLO and of the compiled (optimized) HLO text. `--runtime=1024,2048` also
times the default π train step (window 128, period 128, 3 skips; batch 1) at those lengths: the
median of --steps calls after compilation. `--against=/work/main` times that step side by side
with the code of another checkout: one worker process per tree (PYTHONPATH), compiled once, then
their steps called in turn, so the ratio holds on a loaded machine:

    nice -n 5 python -m experiments.bench_compile_skips --repeats=0 --runtime=1024,2048 \
        --steps=7 --against=/work/main

`--ways=3,4,5,8` times the stride's two ways (`xla.stride.SHIFT_SKIPS`: shifts or the row call)
against each other on the XLA core's forward + backward of π (window 128, period 128, that many
skips, both priors; `[1, 2048, 4, 64]` float32), their calls alternated, the median of --steps each:

    nice -n 5 python -m experiments.bench_compile_skips --repeats=0 --train_step=0 --ways=3,4,5,8 \
        --steps=31 --json=experiments/results/stride_ways.json

`--ways_seq_len=16384` does it at that length instead (`[1, 16384, 4, 64]`).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from efficient_lm.ops import core
from efficient_lm.ops.pattern import Pattern
from experiments.common import REPO

T, WINDOW, PERIOD, NUM_SKIPS = 1024, 32, 16, 63


def _lines(text: str) -> int:
  return text.count("\n") + 1


def _compile(lower, repeats: int) -> dict:
  """Median compile seconds of `lower()` over fresh compiles, and the program's line counts."""
  seconds = []
  for _ in range(repeats):
    jax.clear_caches()
    lowered = lower()
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds.append(time.perf_counter() - start)
  return {"compile_s": statistics.median(seconds), "compile_s_all": seconds,
          "stablehlo_lines": _lines(lowered.as_text()), "hlo_lines": _lines(compiled.as_text())}


def core_program(pattern: Pattern, priors: bool):
  """`lower()` of the XLA core's forward + backward on `[1, T, 4, 32]` float32 inputs."""
  rng = np.random.default_rng(0)
  q, k, v, do = (jnp.asarray(rng.normal(size=(1, T, 4, 32)), jnp.float32) for _ in range(4))
  prior = jnp.asarray(rng.normal(size=(1, T, 4)), jnp.float32) if priors else None

  def loss(q, k, v, lp, sp):
    o, lse = core.attend(q, k, v, pattern, local_prior=lp, skip_prior=sp, impl="xla")
    return jnp.sum(o * do) + jnp.sum(lse)

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4) if priors else (0, 1, 2)))
  return lambda: step.lower(q, k, v, prior, None if prior is None else -prior)


def pi_config(seq_len: int, **model):
  from experiments.common import build, load_config
  config = load_config("configs/pi_attention.py")
  config.data.seq_len, config.data.batch_size, config.data.vocab_size = seq_len, 1, 256
  config.model.update(model)
  return build(config)


def train_program(config):
  from efficient_lm.state import train_state
  from efficient_lm.training import step as train_step
  built = train_state.build(config, seed=0)
  step = train_step.make_train_step(built.graphdef, built.tx, built.schedule, seed=0)
  B, L, V = config.data.batch_size, config.data.seq_len, config.data.vocab_size
  tokens = np.random.default_rng(0).integers(0, V, (B, L + 1)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((B, L), np.float32)}
  return step, built.state, batch


def step_seconds(config, steps: int) -> float:
  step, state, batch = train_program(config)
  from experiments import bench_step  # pylint: disable=import-outside-toplevel
  compiled = step.lower(state, batch).compile()
  return statistics.median(bench_step.time_steps(compiled, state, batch, steps))


def worker(seq_len: int) -> None:
  """Compiles the default π step at `seq_len`, says 'ready', then times one step per input line."""
  step, state, batch = train_program(pi_config(seq_len))
  compiled = step.lower(state, batch).compile()
  state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  print("ready", flush=True)
  for _ in sys.stdin:
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    print(time.perf_counter() - start, flush=True)


def ways_seconds(num_skips: int, steps: int, seq_len: int = 2048) -> dict:
  """Median seconds of π's core forward + backward with the stride as shifts and as the row call,
  their calls alternated (`xla.stride.SHIFT_SKIPS` is read when a call is traced)."""
  from efficient_lm.ops.core.xla import stride
  rng = np.random.default_rng(0)
  q, k, v, do = (jnp.asarray(rng.normal(size=(1, seq_len, 4, 64)), jnp.float32) for _ in range(4))
  prior = jnp.asarray(rng.normal(size=(1, seq_len, 4)), jnp.float32)
  pattern = Pattern.pi(128, 128, num_skips, seq_len=seq_len)

  def loss(q, k, v, lp, sp):
    o, lse = core.attend(q, k, v, pattern, local_prior=lp, skip_prior=sp, impl="xla")
    return jnp.sum(o * do) + jnp.sum(lse)

  compiled = {}
  saved = stride.SHIFT_SKIPS
  for way, limit in (("shifts", num_skips), ("rows", 0)):
    stride.SHIFT_SKIPS = limit
    try:
      step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
      compiled[way] = step.lower(q, k, v, prior, -prior).compile()
    finally:
      stride.SHIFT_SKIPS = saved
    jax.block_until_ready(compiled[way](q, k, v, prior, -prior))
  times = {way: [] for way in compiled}
  for _ in range(steps):
    for way, fn in compiled.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(q, k, v, prior, -prior))
      times[way].append(time.perf_counter() - start)
  result = {way: {"median_s": statistics.median(t), "all_s": t} for way, t in times.items()}
  result["ratio"] = result["shifts"]["median_s"] / result["rows"]["median_s"]
  return result


def side_by_side(seq_len: int, trees: dict, steps: int) -> dict:
  """Median step seconds of each tree's worker, their steps called in turn."""
  procs = {}
  for name, tree in trees.items():
    env = dict(os.environ, PYTHONPATH=tree)
    procs[name] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                                    str(seq_len)], env=env, cwd=tree, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
  for proc in procs.values():
    assert proc.stdout.readline().strip() == "ready"
  times = {name: [] for name in procs}
  for _ in range(steps):
    for name, proc in procs.items():
      proc.stdin.write("step\n")
      proc.stdin.flush()
      times[name].append(float(proc.stdout.readline()))
  for proc in procs.values():
    proc.stdin.close()
    proc.wait()
  return {name: {"median_s": statistics.median(t), "all_s": t} for name, t in times.items()}


def main():
  if len(sys.argv) == 3 and sys.argv[1] == "--worker":
    return worker(int(sys.argv[2]))
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--train_step", type=int, default=1, help="1: also the π train step")
  parser.add_argument("--runtime", default="", help="e.g. 1024,2048: time the default π step")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--against", default="", help="another checkout: time its step beside")
  parser.add_argument("--ways", default="", help="e.g. 3,4,5,8: shifts vs the row call")
  parser.add_argument("--ways_seq_len", type=int, default=2048, help="--ways at this length")
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  window = Pattern.sliding(WINDOW)
  skips = Pattern.pi(WINDOW, PERIOD, NUM_SKIPS, seq_len=T)
  rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                       text=True).stdout.strip()
  result = {"T": T, "window": WINDOW, "period": PERIOD, "num_skips": NUM_SKIPS,
            "skips": len(tuple(m * PERIOD for m in range(1, NUM_SKIPS + 1)
                               if WINDOW <= m * PERIOD < T)),
            "repeats": args.repeats, "git": rev, "jax": jax.__version__,
            "machine": platform.processor() or platform.machine()}
  if args.repeats:
    result["core"] = {"window": _compile(core_program(window, False), args.repeats),
                      "window+skips": _compile(core_program(skips, True), args.repeats)}
  if args.train_step and args.repeats:
    small = dict(d_model=64, num_layers=2, num_heads=2, window=WINDOW, period=PERIOD)
    result["train_step"] = {}
    for name, num_skips in (("window", 0), ("window+skips", NUM_SKIPS)):
      step, state, batch = train_program(pi_config(T, num_skips=num_skips, **small))
      result["train_step"][name] = _compile(lambda: step.lower(state, batch), args.repeats)
  for part in ("core", "train_step"):
    if part in result:
      w, s = result[part]["window"], result[part]["window+skips"]
      result[part]["ratio"] = {key: s[key] / w[key]
                               for key in ("compile_s", "stablehlo_lines", "hlo_lines")}
  if args.runtime and args.against:
    result["runtime_side_by_side"] = {}
    for seq_len in (int(x) for x in args.runtime.split(",")):
      times = side_by_side(seq_len, {"this": REPO, "against": os.path.abspath(args.against)},
                           args.steps)
      times["ratio"] = times["this"]["median_s"] / times["against"]["median_s"]
      result["runtime_side_by_side"][str(seq_len)] = times
  elif args.runtime:
    result["runtime_s"] = {}
    for seq_len in (int(x) for x in args.runtime.split(",")):
      result["runtime_s"][str(seq_len)] = step_seconds(pi_config(seq_len), args.steps)
  if args.ways:
    result[f"ways_T{args.ways_seq_len}"] = {n: ways_seconds(int(n), args.steps, args.ways_seq_len)
                                            for n in args.ways.split(",")}
  print(json.dumps(result, indent=2))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
      f.write("\n")


if __name__ == "__main__":
  main()
