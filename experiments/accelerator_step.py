"""One model's train step on the device, alone in its process: speed, MFU, peak memory.

    python -m experiments.accelerator_step --model=pi_attention --seq_len=32768 [--d_model ...]

The device check (`experiments/accelerator_check.py`) runs this once per model and sequence
length, each in a fresh process, so `peak_bytes_in_use` is that step's own peak. The step is
`step_memory.compile_train_step` (the step `efficient_lm.training.loop` runs), bfloat16, B=1, remat
'block', the config's sequence and loss chunks, `attention_impl='auto'`, on synthetic tokens
(no data pipeline is imported). Prints one line, `ROW {json}`: tokens/s, MFU (analytic model
FLOPs / step time / the chip's bf16 peak), the compiled estimate and the device's peak bytes,
the attention kernels the compiled step calls, the loss; or `error`. Exit 0 when the step ran
with a finite loss, else 1.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import numpy as np

# model name -> config (a path in configs/, ':preset' after it)
MODELS = {"pi_attention": "pi_attention.py", "sliding_window": "sliding_window.py",
          "bcmt": "bcmt.py", "honly": "bcmt.py:honly", "ecp": "ecp.py", "dense": "dense.py"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_tflops(kind: str) -> float | None:
  """The device's dense bfloat16 TFLOP/s (`efficient_lm.training.flops`), None when unknown."""
  from efficient_lm.training import flops  # pylint: disable=import-outside-toplevel
  peak = flops.peak_flops(kind)
  return None if peak is None else peak / 1e12


def model_flops(config, num_params: int) -> float | None:
  """The analytic model FLOPs of one train step (`efficient_lm.training.flops.step_flops`)."""
  from efficient_lm.training import flops  # pylint: disable=import-outside-toplevel
  return flops.step_flops(config, num_params)


def config_for(name: str, T: int, args):
  from efficient_lm.cli import common as cli  # pylint: disable=import-outside-toplevel
  path, _, preset = MODELS[name].partition(":")
  config = cli.load_config(os.path.join(REPO, "configs", path) + (f":{preset}" if preset else ""))
  config.data.update(seq_len=T, batch_size=1, vocab_size=args.vocab_size)
  config.model.update(d_model=args.d_model, num_layers=args.num_layers, num_heads=args.num_heads,
                      dtype="bfloat16", remat="block", attention_impl="auto")
  config.mesh.update(data=1, fsdp=1, tensor=1, context=1)
  if config.model.name == "ecp":
    config.model.num_segments = max(1, T // 256)
  if config.model.get("seq_chunk", 0):
    config.model.seq_chunk = min(config.model.seq_chunk, T)
  config.train.loss_chunk = min(config.train.loss_chunk, T)
  from experiments.common import build  # pylint: disable=import-outside-toplevel
  return build(config)


def first_line(error: BaseException) -> str:
  text = str(error).strip()
  return f"{type(error).__name__}: {text.splitlines()[0][:300]}" if text else type(error).__name__


def run(name: str, T: int, args) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  from efficient_lm.parallel import sharding  # pylint: disable=import-outside-toplevel
  from efficient_lm.training import step_memory  # pylint: disable=import-outside-toplevel
  from efficient_lm.state import train_state  # pylint: disable=import-outside-toplevel
  device = jax.local_devices()[0]
  row = {"model": name, "seq_len": T, "device": device.device_kind}
  config = config_for(name, T, args)
  built = train_state.build(config, sharding.single_device_mesh())
  start = time.perf_counter()
  compiled = step_memory.compile_train_step(config, built)
  row["compile_seconds"] = time.perf_counter() - start
  estimate = step_memory.report(compiled, config, built)
  row.update(attention_backend=estimate["attention_backend"],
             attention_kernels=step_memory.kernel_kinds(compiled.as_text()),
             estimate_bytes=estimate["per_device_total_bytes"])
  tokens = np.random.default_rng(0).integers(0, args.vocab_size, (1, T + 1)).astype(np.int32)
  host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((1, T), np.float32)}
  if built.document_ids:  # the step was compiled with document ids
    host["segment_ids"] = np.zeros((1, T), np.int32)
  batch = sharding.shard_batch(host, built.mesh)
  state, metrics = compiled(built.state, batch)  # warm-up
  jax.block_until_ready(metrics)
  times = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  seconds = statistics.median(times)
  flops = model_flops(config, built.num_params)
  peak = peak_tflops(device.device_kind)
  stats = device.memory_stats() or {}
  loss = float(metrics["loss"])
  row.update(step_seconds=seconds, tokens_per_sec=T / seconds,
             model_tflop=None if flops is None else flops / 1e12,
             mfu=(flops / seconds / (peak * 1e12)) if peak and flops else None,
             peak_bytes_in_use=stats.get("peak_bytes_in_use"), loss=loss)
  if not math.isfinite(loss):
    row["error"] = f"the loss is {loss}"
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", required=True, choices=sorted(MODELS))
  parser.add_argument("--seq_len", type=int, required=True)
  parser.add_argument("--d_model", type=int, default=1024)
  parser.add_argument("--num_layers", type=int, default=4)
  parser.add_argument("--num_heads", type=int, default=8)
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  try:
    row = run(args.model, args.seq_len, args)
  except Exception as error:  # pylint: disable=broad-except  (one row says what went wrong)
    traceback.print_exc(limit=4)
    row = {"model": args.model, "seq_len": args.seq_len, "error": first_line(error)}
  print("ROW " + json.dumps(row), flush=True)
  return 1 if "error" in row else 0


if __name__ == "__main__":
  sys.exit(main())
