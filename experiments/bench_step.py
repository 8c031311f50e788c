"""Whole-model train step: tokens/s, compiled memory and FLOPs, model vs model, side by side.

    python -m experiments.bench_step --configs=configs/dense.py,configs/bcmt.py:128 \
        --seq_len=4096 --batch_size=1 --d_model=256 --num_layers=4 --num_heads=4 --vocab_size=8192

Every config gets the same shared settings (the flags); each model's own fields
keep their config values. The train step (forward, backward, AdamW update) is
the one `efficient_lm.train` runs, on random tokens. Reported: median step time
over --repeats after compilation, tokens/s, the compiled step's temporary memory
(`compiled.memory_analysis()`) and FLOPs (`compiled.cost_analysis()`), and each
figure relative to the first config.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from efficient_lm import models
from efficient_lm import train
from experiments.common import load_config


def measure(spec: str, args) -> dict:
  config = load_config(spec)
  config.data.seq_len = args.seq_len
  config.data.batch_size = args.batch_size
  config.data.vocab_size = args.vocab_size
  for field in ("d_model", "num_layers", "num_heads"):
    config.model[field] = getattr(args, field)
  for override in args.set:  # applied where the model has the field
    field, value = override.split("=")
    if field in config.model:
      config.model[field] = type(config.model[field])(value)
  model = models.create(config.model, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tx, schedule = train.make_optimizer(config.train)
  state = train.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  step = train.make_train_step(graphdef, tx, schedule, seed=0)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, args.vocab_size, (args.batch_size, args.seq_len + 1)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "weights": np.ones((args.batch_size, args.seq_len), np.float32)}
  compiled = step.lower(state, batch).compile()
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  seconds = statistics.median(times)
  return {"config": spec, "model": config.model.name, "step_seconds": seconds,
          "tokens_per_sec": args.batch_size * args.seq_len / seconds,
          "temp_bytes": getattr(memory, "temp_size_in_bytes", float("nan")),
          "flops": float(cost.get("flops", float("nan"))) if cost else float("nan")}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--configs", default="configs/dense.py")
  parser.add_argument("--seq_len", type=int, default=4096)
  parser.add_argument("--batch_size", type=int, default=1)
  parser.add_argument("--d_model", type=int, default=256)
  parser.add_argument("--num_layers", type=int, default=4)
  parser.add_argument("--num_heads", type=int, default=4)
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--set", action="append", default=[],
                      help="model field override for every config that has the field, e.g. --set window=128")
  args = parser.parse_args()
  rows = []
  for spec in args.configs.split(","):
    rows.append(measure(spec, args))
    r = rows[-1]
    print(f"{spec}: {r['tokens_per_sec']:,.0f} tokens/s, temp {r['temp_bytes'] / 2**20:,.1f} MiB, "
          f"{r['flops'] / 1e9:,.1f} GFLOP", flush=True)
  base = rows[0]
  print(f"\nT={args.seq_len} B={args.batch_size} d_model={args.d_model} layers={args.num_layers} "
        f"heads={args.num_heads} vocab={args.vocab_size}; median of {args.repeats} steps\n")
  print("| config | tokens/s | x first | temp MiB | x first | GFLOP | x first |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for r in rows:
    print(f"| {r['config']} | {r['tokens_per_sec']:,.0f} | {r['tokens_per_sec'] / base['tokens_per_sec']:.2f} | "
          f"{r['temp_bytes'] / 2**20:,.1f} | {r['temp_bytes'] / base['temp_bytes']:.2f} | "
          f"{r['flops'] / 1e9:,.1f} | {r['flops'] / base['flops']:.2f} |")


if __name__ == "__main__":
  main()
