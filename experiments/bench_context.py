"""How long a context fits: compiled train-step memory per token against T, every model, and speed.

    nice -n 5 python -m experiments.bench_context                    # every model, T = 4K .. 1M
    python -m experiments.bench_context --models=pi_attention --seq_lens=4096,131072 --no_timing
    python -m experiments.bench_context --quick --out_dir=/tmp/ctx   # tiny sizes (the test runs it)
    python -m experiments.bench_context --target=tpu:v5e:2x2 --impl=auto --seq_lens=1048576 \
        --models=pi_attention,dense:auto --out_name=context_v5e   # compiled for a TPU slice, from here

Per (model, T), B=1, d_model 256, 4 layers, 4 heads, vocab 8192, AdamW: the
train step `python -m efficient_lm.main --compile_only` compiles
(`step_memory.compile_train_step`: the same step, shardings and memory
settings main runs), with the long-context settings `model.remat='block'`,
`train.loss_chunk=8192` and, for the models of bounded reach,
`model.seq_chunk=8192` (dense cannot chunk its sequence: its queries see
everything). Reported: the compiled step's per-device bytes (temporaries,
arguments, outputs: XLA's memory analysis, nothing is run), temporaries per
token, and from them the longest T of the grid whose step fits in 4 / 16 /
64 GiB (arguments + outputs + temporaries). Two dense baselines: `flash`
(the blockwise core: O(T) memory, O(T^2) time) and `reference` (the [T, T] einsum).

Timing (`--timing_seq_lens`, default 4K, 32K, 128K): the median wall time of
--repeats steps after compilation, models side by side at each T (`--interleave`:
every (model, T) compiled first, then one step of each in turn, --repeats rounds,
so that the ratios between Ts are side by side too; no skips); a model
whose single step would take longer than --max_step_seconds (estimated from
the previous T, quadratic for dense) or whose compiled step needs more than
80% of the memory available is skipped and says so. The ratio of
each model's tokens/s to dense flash's and dense reference's at the same T
goes to `speed_ratios`. While timing, a pause file (`--pause_file`) is
created so that background experiments that honour it (`paper_tables`
--pause_file`) stop for the measurement.

`--target=<platform>:<device>:<topology>` (`main --compile_only --target`)
compiles every step for that accelerator's devices instead (the config's
mesh over them, `--batch_size` sequences, default one per device along the
batch axes; the per-platform figure, `step_memory.report`): memory only, no
timing. `--impl` sets `model.attention_impl` for every model but the dense
baselines, which name theirs (`dense:auto`, `dense:xla`, `dense:reference`).

Writes <out_dir>/<out_name>.json (default context, context_quick with --quick)
and <out_dir>/<out_name>_memory.png.
"""

import argparse
import json
import os
import platform
import statistics
import time

import jax
import numpy as np

from efficient_lm import models as models_lib
from efficient_lm.parallel import sharding
from efficient_lm.parallel import targets
from efficient_lm.state import train_state
from efficient_lm.training import step_memory
from experiments import bench_step
from experiments.common import REPO, build, load_config, paused, write_json

MODELS = ("pi_attention,sliding_window,bcmt,bcmt:honly,ecp,gated_deltanet,dense:flash,dense:reference")
SEQ_LENS = "4096,8192,16384,32768,65536,131072,262144,524288,1048576"
BUDGETS_GIB = (4, 16, 64)
CHUNK = 8192


def config_for(key: str, T: int, args):
  """`key` (a config, `dense:flash`/`dense:reference` for the two dense baselines) at context T:
  its ConfigDict (`build` types it)."""
  name, _, variant = key.partition(":")
  impl = variant if name == "dense" else None
  config = load_config(f"configs/{name}.py" + (f":{variant}" if variant and not impl else ""))
  config.data.update(seq_len=T, batch_size=args.batch_size or 1, vocab_size=args.vocab_size)
  config.model.update(d_model=args.d_model, num_layers=args.num_layers, num_heads=args.num_heads)
  config.model.attention_impl = impl or args.impl
  if name == "ecp":
    config.model.num_segments = max(1, T // args.block)  # pieces of --block tokens
  if name == "bcmt":
    config.model.block_size = args.block
  chunk = min(args.chunk, T)
  config.model.remat = "block"
  config.train.loss_chunk = chunk
  config.model.seq_chunk = 0 if name == "dense" or chunk >= T else chunk
  if not args.target:
    config.mesh.update(data=1, fsdp=1, tensor=1, context=1)
  return config


def compile_row(key: str, T: int, args) -> dict:
  config = config_for(key, T, args)
  target = targets.load(args.target, args.num_slices) if args.target else None
  start = time.perf_counter()
  if target is None:
    mesh = sharding.single_device_mesh()
  else:
    mesh = sharding.make_mesh(build(config).mesh, target.devices)
    if not args.batch_size:  # one sequence per device along the batch axes
      config.data.batch_size = mesh.shape["data"] * mesh.shape["fsdp"]
  config = build(config)
  built = train_state.build(config, mesh, abstract=True)
  row = {"model": key, "seq_len": T, "batch_size": config.data.batch_size,
         "attention_backend": models_lib.attention_backend_name(
             config.model, targets.platform_of(list(mesh.devices.flat)))}
  try:
    report = step_memory.report(step_memory.compile_train_step(config, built), config, built,
                                target)
  except step_memory.StepTooLargeError as e:  # the target's compiler found it cannot fit
    row.update(fits=False, error=str(e), compile_seconds=time.perf_counter() - start)
    return row
  row.update(compile_seconds=time.perf_counter() - start,
             **{k: report[k] for k in ("per_device_temp_bytes", "per_device_argument_bytes",
                                       "per_device_output_bytes", "per_device_alias_bytes",
                                       "per_device_total_bytes", "per_device_peak_bytes",
                                       "memory_figure", "per_device_available_bytes", "fits",
                                       "collectives", "mesh")})
  row["temp_bytes_per_token"] = row["per_device_temp_bytes"] / T
  return row


def compile_timed_step(key: str, T: int, args) -> list:
  """[the compiled train step, its state, a batch of random tokens] of `key` at T."""
  config = build(config_for(key, T, args))
  built = train_state.build(config)
  compiled = step_memory.compile_train_step(config, built)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, args.vocab_size, (1, T + 1)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((1, T), np.float32)}
  if built.document_ids:  # the step compiled for document ids: one a row
    batch["segment_ids"] = np.zeros((1, T), np.int32)
  return [compiled, built.state, sharding.shard_batch(batch, built.mesh)]


def time_row(key: str, T: int, args) -> float:
  """Median seconds of one train step (after compilation)."""
  compiled, state, batch = compile_timed_step(key, T, args)
  return statistics.median(bench_step.time_steps(compiled, state, batch, args.repeats,
                                                 give_up_seconds=args.max_step_seconds))


def time_interleaved(rows: list[tuple[str, int]], args) -> dict:
  """{(key, T): median seconds}: every row compiled first, one warm-up step each, then --repeats
  rounds of one step of every row in turn, so that a load drifting during the run moves every
  row alike (the ratios between Ts are then side by side, as those between models)."""
  steps = {row: compile_timed_step(*row, args) for row in rows}
  times = bench_step.time_interleaved(steps, args.repeats)
  return {row: statistics.median(t) for row, t in times.items()}


def speed_ratios(timing: list[dict]) -> dict:
  """tokens/s of each model over dense flash's and dense reference's at the same T (where timed)."""
  speed = {(r["model"], r["seq_len"]): r["tokens_per_sec"] for r in timing if "tokens_per_sec" in r}
  ratios = {}
  for (model, T), tps in speed.items():
    for base in ("dense:flash", "dense:reference"):
      if model != base and (base, T) in speed:
        ratios.setdefault(model, {}).setdefault(str(T), {})[f"vs {base}"] = tps / speed[(base, T)]
  return ratios


def longest_fitting(rows: list[dict], budget_gib: float | None) -> int | None:
  """The longest T whose step fits in `budget_gib` (None: the device's own limit, `fits`)."""
  fits = [r["seq_len"] for r in rows if r.get("fits", True) and "per_device_total_bytes" in r
          and (budget_gib is None or r["per_device_total_bytes"] <= budget_gib * 2**30)]
  return max(fits) if fits else None


def plot(result: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for key in result["models"]:
    rows = [r for r in result["memory"] if r["model"] == key and "per_device_total_bytes" in r]
    ax.plot([r["seq_len"] for r in rows], [r["per_device_total_bytes"] / 2**30 for r in rows],
            marker="o", label=key)
  for budget in BUDGETS_GIB:
    ax.axhline(budget, color="gray", lw=0.6, ls="--")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log", base=2)
  ax.set_xlabel("context T (tokens), batch 1")
  ax.set_ylabel("compiled train step, GiB per device")
  s = result["settings"]
  ax.set_title(f"d_model {s['d_model']}, {s['num_layers']} layers, vocab {s['vocab_size']}; "
               f"remat block, loss/sequence chunks {s['chunk']}", fontsize=9)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", default=MODELS)
  parser.add_argument("--seq_lens", default=SEQ_LENS)
  parser.add_argument("--timing_seq_lens", default="4096,32768,131072")
  parser.add_argument("--no_timing", action="store_true")
  parser.add_argument("--interleave", action="store_true",
                      help="time every (model, T) of --timing_seq_lens compiled first, then one "
                           "step of each in turn, --repeats rounds (no skips: for a few rows)")
  parser.add_argument("--d_model", type=int, default=256)
  parser.add_argument("--num_layers", type=int, default=4)
  parser.add_argument("--num_heads", type=int, default=4)
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--block", type=int, default=256, help="BCMT block, ECP piece length")
  parser.add_argument("--chunk", type=int, default=CHUNK, help="train.loss_chunk and model.seq_chunk")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--max_step_seconds", type=float, default=300.0)
  parser.add_argument("--max_gib", type=float, default=256.0,
                      help="stop growing T for a model past this many GiB (compile only)")
  parser.add_argument("--pause_file", default="/tmp/efficient_lm_quiet")
  parser.add_argument("--quick", action="store_true", help="tiny sizes: seconds, for the test")
  parser.add_argument("--out_dir", default=os.path.join(REPO, "experiments", "results"))
  parser.add_argument("--out_name", default="", help="result file stem (default context[_quick])")
  parser.add_argument("--target", default="", help="compile for <platform>:<device>:<topology> "
                      "(e.g. tpu:v5e:2x2, gpu:h200:1x1x1) instead of this host: memory only")
  parser.add_argument("--num_slices", type=int, default=1)
  parser.add_argument("--batch_size", type=int, default=0,
                      help="sequences a step (0: 1, or one per device along a target's batch axes)")
  parser.add_argument("--impl", default="auto", help="model.attention_impl of the efficient models")
  args = parser.parse_args()
  if args.target:
    targets.prepare_host()
    args.no_timing = True
  if args.quick:
    args.d_model, args.num_layers, args.num_heads, args.vocab_size = 32, 2, 2, 512
    args.block, args.chunk, args.repeats, args.pause_file = 16, 64, 1, ""
    if args.seq_lens == SEQ_LENS:
      args.seq_lens = "128,256"
    if args.timing_seq_lens == "4096,32768,131072":
      args.timing_seq_lens = "128"
  models = args.models.split(",")
  name = args.out_name or ("context_quick" if args.quick else "context")
  os.makedirs(args.out_dir, exist_ok=True)
  out = os.path.join(args.out_dir, f"{name}.json")
  result = {"settings": {k: getattr(args, k) for k in ("d_model", "num_layers", "num_heads",
                                                       "vocab_size", "block", "chunk", "repeats",
                                                       "target", "num_slices", "impl")},
            "command": "python -m experiments.bench_context " + " ".join(
                f"--{k}={v}" for k, v in vars(args).items() if k not in ("out_dir",)),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {jax.devices()[0].platform}"
                       + (f", compiled for {args.target}" if args.target else ""),
            "models": models, "memory": [], "timing": []}

  def save():
    write_json(out, result)

  for key in models:
    for T in map(int, args.seq_lens.split(",")):
      row = compile_row(key, T, args)
      result["memory"].append(row)
      if "error" in row:
        print(f"{key} T={T:,}: does not fit ({row['error'][:160]})", flush=True)
        save()
        break
      print(f"{key} T={T:,}: {row['per_device_total_bytes'] / 2**30:,.2f} GiB"
            f"{'' if row['fits'] else ' (does not fit)'}, "
            f"{row['temp_bytes_per_token'] / 1024:,.1f} KiB temp/token "
            f"(compiled in {row['compile_seconds']:.0f} s)", flush=True)
      save()
      if row["per_device_total_bytes"] > args.max_gib * 2**30:
        break
  budgets = (None,) if args.target else BUDGETS_GIB
  result["fits"] = {key: {("device" if b is None else f"{b} GiB"): longest_fitting(
      [r for r in result["memory"] if r["model"] == key], b) for b in budgets} for key in models}
  if not args.no_timing and args.interleave:
    with paused(args.pause_file):
      rows = [(key, T) for T in map(int, args.timing_seq_lens.split(",")) for key in models]
      for (key, T), seconds in time_interleaved(rows, args).items():
        result["timing"].append({"model": key, "seq_len": T, "step_seconds": seconds,
                                 "tokens_per_sec": T / seconds, "interleaved": True,
                                 "load_average": os.getloadavg()[0]})
        print(f"{key} T={T:,}: {T / seconds:,.0f} tokens/s ({seconds:.2f} s a step, interleaved)",
              flush=True)
      save()
  elif not args.no_timing:
    estimate = {}
    with paused(args.pause_file):
      for T in map(int, args.timing_seq_lens.split(",")):
        for key in models:
          guess = None
          if key in estimate:  # the last timing, scaled: linear in T, quadratic for dense
            seconds_then, T_then = estimate[key]
            guess = seconds_then * (T / T_then) ** (2 if key.startswith("dense") else 1)
          needs = next((r["per_device_total_bytes"] for r in result["memory"]
                        if r["model"] == key and r["seq_len"] == T), None)
          available = step_memory.available_bytes()[0]
          if needs is None or (available is not None and needs > 0.8 * available):
            why = "not compiled at this T" if needs is None else (
                f"needs {needs / 2**30:,.1f} GiB, over 80% of the {available / 2**30:,.1f} GiB available")
            result["timing"].append({"model": key, "seq_len": T, "skipped": why})
            print(f"{key} T={T:,}: skipped ({why})", flush=True)
            continue
          if guess is not None and guess > args.max_step_seconds:
            result["timing"].append({"model": key, "seq_len": T, "skipped":
                                     f"estimated {guess:,.0f} s a step > --max_step_seconds"})
            print(f"{key} T={T:,}: skipped (estimated {guess:,.0f} s a step)", flush=True)
            continue
          seconds = time_row(key, T, args)
          result["timing"].append({"model": key, "seq_len": T, "step_seconds": seconds,
                                   "tokens_per_sec": T / seconds,
                                   "load_average": os.getloadavg()[0]})
          print(f"{key} T={T:,}: {T / seconds:,.0f} tokens/s ({seconds:.2f} s a step)", flush=True)
          save()
          estimate[key] = (seconds, T)
  result["speed_ratios"] = speed_ratios(result["timing"])
  save()
  plot(result, os.path.join(args.out_dir, f"{name}_memory.png"))
  print(json.dumps(result["fits"], indent=1))


if __name__ == "__main__":
  main()
