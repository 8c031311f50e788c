"""Whole-model train step: tokens/s, compiled memory and FLOPs, model vs model, side by side.

    python -m experiments.bench_step --configs=configs/dense.py,configs/bcmt.py:128 \
        --seq_len=4096 --batch_size=1 --d_model=256 --num_layers=4 --num_heads=4 --vocab_size=8192

Every config gets the same shared settings (the flags); each model's own fields
keep their config values. The train step (forward, backward, AdamW update) is
the one `efficient_lm.training.loop` runs, on random tokens. Reported: median step time
over --repeats after compilation, tokens/s, the compiled step's temporary memory
(`compiled.memory_analysis()`) and FLOPs (`train_step_flops`: the cost analysis
with every layer counted), and each figure relative to the first config. `--documents=0,8`
measures every config without document ids and with 8 equal documents a row (`segment_ids`, as
`data.document_mask` trains), side by side.
"""

import argparse
import contextlib
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from efficient_lm import models
from efficient_lm.ops.recurrent import chunked as recurrent_chunked
from efficient_lm.state import train_state
from efficient_lm.training import flops
from efficient_lm.training import step as train_step
from experiments.common import build, load_config


def compile_train_step(config, *, seed: int = 0, documents: int = 0):
  """The train step `efficient_lm.training.loop` runs, compiled for `config` on random tokens (with
  `documents` > 0, cut into that many equal documents a row by `segment_ids`).

  Returns (compiled, state, batch, memory_analysis, cost_analysis); shared by the
  benchmark harness and the paper tables.
  """
  B, T, V = config.data.batch_size, config.data.seq_len, config.data.vocab_size
  built = train_state.build(config, seed=seed)
  state = built.state
  step = train_step.make_train_step(built.graphdef, built.tx, built.schedule, seed=seed)
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (B, T + 1)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((B, T), np.float32)}
  if documents:
    batch["segment_ids"] = np.broadcast_to(np.arange(T) * documents // T, (B, T)).astype(np.int32)
  compiled = step.lower(state, batch).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return compiled, state, batch, compiled.memory_analysis(), cost


@contextlib.contextmanager
def _unrolled_layers():
  """Registry models build their layers unrolled (no `nnx.scan`) inside the block."""
  saved = dict(models.REGISTRY)
  for name, entry in saved.items():
    models.REGISTRY[name] = dataclasses.replace(entry, identical_layers=lambda cfg: False)
  try:
    yield
  finally:
    models.REGISTRY.update(saved)


@contextlib.contextmanager
def _unrolled_recurrence():
  """The gated delta rule's state scan across chunks laid out step by step (`unroll=True`), so
  that every chunk's step is counted, not one."""
  saved = recurrent_chunked.state_scan
  recurrent_chunked.state_scan = functools.partial(saved, unroll=True)
  try:
    yield
  finally:
    recurrent_chunked.state_scan = saved


def _lowered_flops(config, seed: int) -> float:
  B, T = config.data.batch_size, config.data.seq_len
  built = train_state.build(config, abstract=True, seed=seed)
  batch = {"inputs": jax.ShapeDtypeStruct((B, T), jnp.int32), "targets": jax.ShapeDtypeStruct((B, T), jnp.int32),
           "weights": jax.ShapeDtypeStruct((B, T), jnp.float32)}
  step = train_step.make_train_step(built.graphdef, built.tx, built.schedule, seed=seed)
  cost = step.lower(built.state, batch).cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", float("nan"))) if cost else float("nan")


def train_step_flops(config, *, seed: int = 0) -> float:
  """FLOPs of one train step with every layer counted.

  XLA's cost analysis counts a loop body once, whatever its trip count, so the
  `compiled.cost_analysis()` of a model whose layers run under `nnx.scan` misses
  all but one layer. Here the decoder models are built unrolled; the
  Perceiver-AR family (whose layers 2.. always scan; a scan of one layer is
  counted right) is counted as f(1 layer) + (num_layers - 1) * (f(2) - f(1)).
  The gated delta rule's state scan across chunks is counted unrolled too.
  """
  with _unrolled_recurrence():
    if models.REGISTRY[config.model.name].build is None or config.model.num_layers <= 2:
      with _unrolled_layers():
        return _lowered_flops(config, seed)
    f = {}
    for layers in (1, 2):
      small = dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=layers))
      f[layers] = _lowered_flops(small, seed)
    return f[1] + (config.model.num_layers - 1) * (f[2] - f[1])


def time_interleaved(steps: dict, repeats: int) -> dict:
  """{name: [seconds of each timed step]} of `steps` ({name: [compiled, state, batch]}, the state
  replaced as it trains): one warm-up step each, then `repeats` rounds of one step of every entry
  in turn, so that a load drifting during the run moves every entry alike."""
  times = {name: [] for name in steps}
  for round_ in range(repeats + 1):  # round 0: the warm-up, not timed
    for name, step in steps.items():
      start = time.perf_counter()
      step[1], metrics = step[0](step[1], step[2])
      jax.block_until_ready(metrics)
      if round_:
        times[name].append(time.perf_counter() - start)
  return times


def model_flops(config, *, seed: int = 0) -> float | None:
  """The model FLOPs of one train step, counted analytically (`efficient_lm.training.flops`, as
  MFU while training): every layer, every key block and every chunk of the recurrence, no
  rematerialisation. Where `train_step_flops` (what XLA compiles) counts loops' bodies once, this
  counts what the model does, so it is the one an MFU divides."""
  built = train_state.build(config, abstract=True, seed=seed)
  return flops.step_flops(config, built.num_params)


def apply_settings(config, args) -> None:
  """The shared flags onto a config; --set overrides only where the model has the field."""
  config.data.seq_len = args.seq_len
  config.data.batch_size = args.batch_size
  config.data.vocab_size = args.vocab_size
  for field in ("d_model", "num_layers", "num_heads"):
    config.model[field] = getattr(args, field)
  for override in args.set:
    field, value = override.split("=")
    if field in config.model:
      config.model[field] = type(config.model[field])(value)


def time_steps(compiled, state, batch, repeats: int, give_up_seconds: float = float("inf")
               ) -> list[float]:
  """Seconds of `repeats` train steps after one warm-up step; stops early once a step takes longer
  than `give_up_seconds` (one timing is enough to say a model is far too slow)."""
  state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
    if times[-1] > give_up_seconds:
      break
  return times


def measure(spec: str, args, documents: int = 0) -> dict:
  config = load_config(spec)
  apply_settings(config, args)
  config = build(config)
  compiled, state, batch, memory, cost = compile_train_step(config, documents=documents)
  seconds = statistics.median(time_steps(compiled, state, batch, args.repeats))
  label = spec + (f" ({documents} documents)" if documents else "")
  return {"config": label, "model": config.model.name, "step_seconds": seconds,
          "tokens_per_sec": args.batch_size * args.seq_len / seconds,
          "temp_bytes": getattr(memory, "temp_size_in_bytes", float("nan")),
          "flops": train_step_flops(config)}


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
  parser.add_argument("--documents", default="0",
                      help="comma list of document counts a row (0: no document ids)")
  parser.add_argument("--json", default="", help="also write the rows to this file")
  parser.add_argument("--set", action="append", default=[],
                      help="model field override for every config that has the field, e.g. --set window=128")
  args = parser.parse_args()
  rows = []
  for spec in args.configs.split(","):
    for documents in map(int, args.documents.split(",")):
      rows.append(measure(spec, args, documents))
      r = rows[-1]
      print(f"{r['config']}: {r['tokens_per_sec']:,.0f} tokens/s, temp {r['temp_bytes'] / 2**20:,.1f} "
            f"MiB, {r['flops'] / 1e9:,.1f} GFLOP", flush=True)
  base = rows[0]
  print(f"\nT={args.seq_len} B={args.batch_size} d_model={args.d_model} layers={args.num_layers} "
        f"heads={args.num_heads} vocab={args.vocab_size}; median of {args.repeats} steps\n")
  print("| config | tokens/s | x first | temp MiB | x first | GFLOP | x first |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for r in rows:
    print(f"| {r['config']} | {r['tokens_per_sec']:,.0f} | {r['tokens_per_sec'] / base['tokens_per_sec']:.2f} | "
          f"{r['temp_bytes'] / 2**20:,.1f} | {r['temp_bytes'] / base['temp_bytes']:.2f} | "
          f"{r['flops'] / 1e9:,.1f} | {r['flops'] / base['flops']:.2f} |")
  if args.json:
    import json  # pylint: disable=import-outside-toplevel
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"settings": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
