"""What the stop agreement costs a step: train steps with and without `StopAgreement.poll`, side by side.

    nice python -m experiments.bench_stop_agreement --out=experiments/results/stop_agreement.json

Starts `--num_processes` local processes (gloo, one CPU device each) as one job, as
`efficient_lm.main` does. Every process builds the train step of each `--configs` entry (its
`data.batch_size` split over the processes) and times rounds of `--steps` steps, alternating a
round without the agreement and a round with `poll` after every step (what the training loop
does); each step's metrics are fetched as the loop's progress line would be, once per round.
Reported: the median seconds a step of each kind, their ratio, and process 0's figures (every
process runs the same steps).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def launch(args) -> None:
  address = f"localhost:{free_port()}"
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  workers = [subprocess.Popen([sys.executable, "-m", "experiments.bench_stop_agreement", *sys.argv[1:],
                               f"--coordinator_address={address}", f"--process_id={i}"],
                              cwd=REPO, env=env) for i in range(args.num_processes)]
  statuses = [w.wait() for w in workers]
  if any(statuses):
    sys.exit(f"error: worker statuses {statuses}")


def measure(spec: str, args, agreement) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from efficient_lm.parallel import sharding  # pylint: disable=import-outside-toplevel
  from efficient_lm.training import step_memory  # pylint: disable=import-outside-toplevel
  from efficient_lm.state import train_state  # pylint: disable=import-outside-toplevel
  from experiments.common import build, load_config  # pylint: disable=import-outside-toplevel
  config = load_config(spec)
  for override in args.overrides.split(",") if args.overrides else []:
    field, value = override.split("=")
    section, name = field.split(".")
    config[section][name] = type(config[section][name])(value)
  config = build(config)
  built = train_state.build(config, sharding.make_mesh(config.mesh))  # every process's devices
  compiled = step_memory.compile_train_step(config, built)
  B, T = config.data.batch_size, config.data.seq_len
  tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (B, T + 1)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((B, T), np.float32)}
  if built.document_ids:
    batch["segment_ids"] = np.zeros((B, T), np.int32)
  batch = sharding.shard_batch(batch, built.mesh)
  state = built.state
  state, metrics = compiled(state, batch)  # warm-up (and the agreement's own compile)
  agreement.poll(None)
  jax.block_until_ready(metrics)
  times = {"without": [], "with": []}
  for r in range(2 * args.rounds):
    kind = ("without", "with")[r % 2]
    start = time.perf_counter()
    for _ in range(args.steps):
      state, metrics = compiled(state, batch)
      if kind == "with":
        agreement.poll(None)
    jax.device_get(metrics)
    times[kind].append((time.perf_counter() - start) / args.steps)
  out = {"config": spec, "batch_size": B, "seq_len": T,
         **{f"step_seconds_{k}": statistics.median(v) for k, v in times.items()}}
  out["ratio_with_over_without"] = out["step_seconds_with"] / out["step_seconds_without"]
  out["agreement_ms_per_step"] = 1e3 * (out["step_seconds_with"] - out["step_seconds_without"])
  return out


def worker(args) -> None:
  from efficient_lm.parallel import distributed  # pylint: disable=import-outside-toplevel
  distributed.initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
  agreement = distributed.StopAgreement()
  rows = [measure(spec, args, agreement) for spec in args.configs.split(",")]
  if args.process_id == 0:
    for row in rows:
      print(f"{row['config']}: {row['step_seconds_without'] * 1e3:.1f} ms a step without the "
            f"agreement, {row['step_seconds_with'] * 1e3:.1f} ms with it "
            f"(ratio {row['ratio_with_over_without']:.3f})", flush=True)
    result = {"command": "python -m experiments.bench_stop_agreement " + " ".join(
        a for a in sys.argv[1:] if not a.startswith(("--coordinator_address", "--process_id"))),
              "num_processes": args.num_processes, "steps_per_round": args.steps,
              "rounds": args.rounds, "load_average": os.getloadavg(), "rows": rows,
              "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
    print(f"wrote {args.out}", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--configs", default="configs/pi_attention.py,configs/dense.py")
  parser.add_argument("--overrides", default="", help="e.g. data.batch_size=2,train.loss_chunk=0")
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--steps", type=int, default=10, help="steps a round")
  parser.add_argument("--rounds", type=int, default=5, help="rounds of each kind, alternating")
  parser.add_argument("--out", default="experiments/results/stop_agreement.json")
  parser.add_argument("--coordinator_address", default=None)
  parser.add_argument("--process_id", type=int, default=None)
  args = parser.parse_args()
  if args.process_id is None:
    launch(args)
  else:
    worker(args)


if __name__ == "__main__":
  main()
