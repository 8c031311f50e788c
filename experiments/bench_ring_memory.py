"""Per-device memory of the context-parallel π-Attention train step: T = devices x C vs one device at C.

    python -m experiments.bench_ring_memory            # 8 fake CPU devices, T = 65536 vs 8192

Compiles (does not run) the train step `efficient_lm.training.loop` runs (forward,
backward, AdamW update) twice for the same small π model: on one device at
T = C, and with the sequence sharded over `--devices` (mesh.context) at
T = devices x C. Reported per device, from `compiled.memory_analysis()`:
temporary bytes, argument bytes (parameters, optimizer state, this device's
slice of the batch) and their sum, plus the collectives in the sharded step's
HLO (collective-permutes, and all-gathers, which there should be none of).
The goal: about equal, memory per device set by C, not T. The script re-runs
itself in a subprocess with XLA_FLAGS set when jax sees too few devices.
"""

import argparse
import json
import os
import re
import subprocess
import sys

from experiments.common import REPO


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8, help="devices along the sequence (mesh.context)")
  parser.add_argument("--chunk", type=int, default=8192, help="C: tokens per device")
  parser.add_argument("--d_model", type=int, default=128)
  parser.add_argument("--num_layers", type=int, default=2)
  parser.add_argument("--num_heads", type=int, default=4)
  parser.add_argument("--vocab_size", type=int, default=1024)
  parser.add_argument("--window", type=int, default=128)
  parser.add_argument("--period", type=int, default=128)
  parser.add_argument("--num_skips", type=int, default=3)
  return parser.parse_args(argv)


def measure(args, context: int) -> dict:
  """Compiles the train step at T = context x chunk on a (1, context) mesh; per-device figures."""
  import jax
  import numpy as np

  from efficient_lm.training import loop as train
  from efficient_lm.training import evaluate as training_evaluate
  from efficient_lm.state import train_state
  from efficient_lm.training import step as train_step
  from experiments.common import build, load_config

  config = load_config("configs/pi_attention.py")
  T = context * args.chunk
  config.data.update(seq_len=T, batch_size=1, vocab_size=args.vocab_size)
  config.model.update(d_model=args.d_model, num_layers=args.num_layers, num_heads=args.num_heads,
                      window=args.window, period=args.period, num_skips=args.num_skips)
  mesh = jax.make_mesh((1, context), ("data", "context"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:context])
  built = train_state.build(build(config), mesh, seed=0)
  tokens = np.random.default_rng(0).integers(0, args.vocab_size, (1, T + 1)).astype(np.int32)
  batch = training_evaluate.place_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                             "weights": np.ones((1, T), np.float32)}, mesh)
  compiled = train_step.make_train_step(built.graphdef, built.tx, built.schedule, seed=0).lower(
      built.state, batch).compile()
  memory = compiled.memory_analysis()
  hlo = compiled.as_text()
  count = lambda op: len(re.findall(rf"= [^=]*\b{op}(-start)?\(", hlo))
  return {"devices": context, "seq_len": T, "tokens_per_device": args.chunk,
          "temp_bytes": memory.temp_size_in_bytes, "argument_bytes": memory.argument_size_in_bytes,
          "peak_bytes": memory.temp_size_in_bytes + memory.argument_size_in_bytes,
          "collective_permutes": count("collective-permute"), "all_gathers": count("all-gather")}


def main(argv=None) -> None:
  args = parse_args(argv)
  import jax
  if jax.device_count() < args.devices:  # jax already started: ask a fresh process for fake devices
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                                      + f" --xla_force_host_platform_device_count={args.devices}"))
    sys.exit(subprocess.run([sys.executable, "-m", "experiments.bench_ring_memory",
                             *(argv if argv is not None else sys.argv[1:])], env=env, cwd=REPO).returncode)
  rows = [measure(args, 1), measure(args, args.devices)]
  mib = lambda b: f"{b / 2**20:9.1f}"
  print(f"π-Attention train step, d_model {args.d_model}, {args.num_layers} layers, window "
        f"{args.window}, period {args.period}, {args.num_skips} skips, vocab {args.vocab_size}, batch 1")
  print("devices  seq_len  tokens/device  temp MiB  args MiB  peak MiB  collective-permutes  all-gathers")
  for r in rows:
    print(f"{r['devices']:7d}  {r['seq_len']:7d}  {r['tokens_per_device']:13d}  {mib(r['temp_bytes'])} "
          f"{mib(r['argument_bytes'])} {mib(r['peak_bytes'])}  {r['collective_permutes']:19d}  "
          f"{r['all_gathers']:11d}")
  print(f"sharded / single-device peak per device: {rows[1]['peak_bytes'] / rows[0]['peak_bytes']:.3f}")
  print(json.dumps(rows))


if __name__ == "__main__":
  main()
