"""How long a checkpoint save stalls training: asynchronous against synchronous, side by side.

    python -m experiments.bench_checkpoint                 # a 1 GiB state, 3 saves of each
    python -m experiments.bench_checkpoint --gib=0.05 --repeats=1 --out=/tmp/c.json   # the test

The state is float32 arrays of --gib GiB in all (shaped like a model's: a few large matrices);
`checkpoint.Checkpointer.save` is timed as the loop sees it (the call's return), once with
asynchronous saves (Orbax writes in the background: then `wait` is timed apart) and once
synchronous (the call returns when the checkpoint is committed). Median of --repeats, one process,
the two modes alternating. Writes experiments/results/checkpoint.json.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from efficient_lm.state import checkpoint
from experiments.common import REPO


def state_of(gib: float) -> dict:
  rows = max(1, int(gib * 2**30 / 4 / 4 / 4096))
  keys = jax.random.split(jax.random.key(0), 4)
  return {f"w{i}": jax.random.normal(k, (rows, 4096), jnp.float32) for i, k in enumerate(keys)}


def time_saves(state, asynchronous: bool, repeats: int, folder: str) -> dict:
  ckpt = checkpoint.Checkpointer(folder, max_to_keep=2, asynchronous=asynchronous)
  blocked, committed = [], []
  for step in range(1, repeats + 1):
    start = time.perf_counter()
    ckpt.save(step, state, {"position": step}, {"model_name": "bench"})
    blocked.append(time.perf_counter() - start)
    ckpt.wait()
    committed.append(time.perf_counter() - start)
  ckpt.close()
  return {"blocked_seconds": statistics.median(blocked),
          "committed_seconds": statistics.median(committed)}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--gib", type=float, default=1.0)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default=os.path.join(REPO, "experiments", "results", "checkpoint.json"))
  args = parser.parse_args(argv)
  state = state_of(args.gib)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  results = {"state_bytes": nbytes, "repeats": args.repeats,
             "command": "python -m experiments.bench_checkpoint " + " ".join(argv or [])}
  with tempfile.TemporaryDirectory() as tmp:
    for mode, asynchronous in (("synchronous", False), ("asynchronous", True)):
      results[mode] = time_saves(state, asynchronous, args.repeats, os.path.join(tmp, mode))
  results["blocked_ratio"] = (results["asynchronous"]["blocked_seconds"]
                              / results["synchronous"]["blocked_seconds"])
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1)
  print(f"state {nbytes / 2**30:.2f} GiB: a synchronous save blocks "
        f"{results['synchronous']['blocked_seconds']:.2f} s, an asynchronous one "
        f"{results['asynchronous']['blocked_seconds']:.3f} s (ratio {results['blocked_ratio']:.3f}; "
        f"committed after {results['asynchronous']['committed_seconds']:.2f} s)")


if __name__ == "__main__":
  main()
