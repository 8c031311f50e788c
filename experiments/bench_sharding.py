"""What FSDP buys: per-device train-state bytes and compiled temporaries, replicated against sharded.

    python -m experiments.bench_sharding                  # d_model 256 .. 4096 on 8 fake CPU devices
    python -m experiments.bench_sharding --quick --out_dir=/tmp/shard   # tiny sizes (the test runs it)

For each size (d_model, layers) of the grid, a π-Attention model (vocab 8192,
context 2048, batch 8, AdamW, `model.remat='block'`) is built abstractly
(`train_state.build(..., abstract=True)`: no array is allocated) and its
real train step compiled (`step_memory.compile_train_step`, the step main
runs) on two meshes of the same 8 devices:

- replicated: `mesh.data=8` (plain data parallelism: every device holds the
  whole train state);
- fsdp: `mesh.fsdp=8` (parameters and optimizer state sharded by the
  default logical-axis rules).

Reported per device: parameter and optimizer bytes (and the replicated
fraction), the compiled step's temporaries and its total live bytes
(arguments + outputs - donated aliases + temporaries), and the largest size
of the grid whose step fits in --budget_gib each way. Nothing is run: these
are XLA's memory analysis of the compiled step, so the fake CPU devices
stand in for accelerators of that memory.

Writes <out_dir>/sharding.json (sharding_quick.json with --quick).
"""

import os
import sys

if "jax" not in sys.modules:  # eight devices on a CPU box, before jax is imported
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import argparse  # pylint: disable=g-import-not-at-top,wrong-import-position
import json
import platform
import time

import jax

from efficient_lm.parallel import sharding
from efficient_lm.state import train_state
from efficient_lm.training import step_memory
from experiments.common import REPO, build, load_config, write_json

SIZES = "256x4,512x8,1024x16,2048x24,3072x32,4096x40"
MESHES = {"replicated": dict(data=8, fsdp=1, tensor=1, context=1),
          "fsdp": dict(data=1, fsdp=8, tensor=1, context=1)}


def config_for(d_model: int, num_layers: int, mesh: dict, args):
  config = load_config("configs/pi_attention.py")
  config.data.update(seq_len=args.seq_len, batch_size=args.batch_size, vocab_size=args.vocab_size)
  config.model.update(d_model=d_model, num_layers=num_layers, num_heads=max(2, d_model // 128),
                      remat="block")
  config.train.loss_chunk = min(args.seq_len, 1024)
  config.mesh.update(**mesh)
  return build(config)


def measure(d_model: int, num_layers: int, mesh_name: str, args) -> dict:
  config = config_for(d_model, num_layers, MESHES[mesh_name], args)
  start = time.perf_counter()
  built = train_state.build(config, sharding.make_mesh(config.mesh), abstract=True)
  report = step_memory.report(step_memory.compile_train_step(config, built), config, built)
  keep = ("per_device_param_bytes", "param_replicated_fraction", "per_device_optimizer_bytes",
          "optimizer_replicated_fraction", "per_device_temp_bytes", "per_device_argument_bytes",
          "per_device_total_bytes", "mesh")
  return {"d_model": d_model, "num_layers": num_layers, "mesh_name": mesh_name,
          "num_params": built.num_params, "compile_seconds": time.perf_counter() - start,
          "per_device_state_bytes": report["per_device_param_bytes"]
                                    + report["per_device_optimizer_bytes"],
          **{k: report[k] for k in keep}}


def largest_fitting(rows: list[dict], mesh_name: str, budget_bytes: float) -> dict | None:
  fits = [r for r in rows if r["mesh_name"] == mesh_name and r["per_device_total_bytes"] <= budget_bytes]
  if not fits:
    return None
  best = max(fits, key=lambda r: r["num_params"])
  return {"d_model": best["d_model"], "num_layers": best["num_layers"], "num_params": best["num_params"]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default=SIZES, help="d_model x layers, comma separated")
  parser.add_argument("--seq_len", type=int, default=2048)
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--budget_gib", type=float, default=16.0)
  parser.add_argument("--quick", action="store_true", help="tiny sizes: seconds, for the test")
  parser.add_argument("--out_dir", default=os.path.join(REPO, "experiments", "results"))
  args = parser.parse_args()
  if jax.device_count() != 8:
    sys.exit(f"bench_sharding needs 8 devices, found {jax.device_count()} "
             "(run it as a script: it asks XLA for 8 CPU devices before jax starts)")
  if args.quick:
    args.seq_len, args.batch_size, args.vocab_size = 64, 8, 512
    if args.sizes == SIZES:
      args.sizes = "64x2,128x2"
  sizes = [tuple(map(int, s.split("x"))) for s in args.sizes.split(",")]
  os.makedirs(args.out_dir, exist_ok=True)
  out = os.path.join(args.out_dir, "sharding_quick.json" if args.quick else "sharding.json")
  result = {"command": "python -m experiments.bench_sharding " + " ".join(
                f"--{k}={v}" for k, v in vars(args).items() if k != "out_dir"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, 8 fake {jax.devices()[0].platform} "
                       "devices (compile only)",
            "model": "pi_attention", "meshes": MESHES, "rows": []}
  for d_model, num_layers in sizes:
    for mesh_name in MESHES:
      row = measure(d_model, num_layers, mesh_name, args)
      result["rows"].append(row)
      print(f"d_model {d_model:>5} x {num_layers:>2} layers ({row['num_params'] / 1e6:,.0f}M params), "
            f"{mesh_name:>10}: state {row['per_device_state_bytes'] / 2**30:8.3f} GiB/device "
            f"({row['param_replicated_fraction']:.0%} replicated), temps "
            f"{row['per_device_temp_bytes'] / 2**30:7.3f} GiB, total "
            f"{row['per_device_total_bytes'] / 2**30:7.3f} GiB", flush=True)
  budget = args.budget_gib * 2**30
  result["largest_fitting"] = {name: largest_fitting(result["rows"], name, budget) for name in MESHES}
  result["budget_gib"] = args.budget_gib
  write_json(out, result)
  print(f"largest fitting {args.budget_gib:g} GiB per device: {json.dumps(result['largest_fitting'])}")


if __name__ == "__main__":
  main()
