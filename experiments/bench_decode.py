"""Decoding speed and cache size against the context length, model vs model, side by side.

    python -m experiments.bench_decode \
        --configs=configs/dense.py,configs/sliding_window.py,configs/pi_attention.py,configs/bcmt.py \
        --contexts=2048,8192,32768 --d_model=256 --num_layers=4 --num_heads=4 --vocab_size=8192

For each model and context C: a real prefill of C random tokens (one parallel
pass, or chunks of --prefill_chunk tokens for the dense baseline, whose one
pass would hold a [C, C] score matrix), then --new_tokens greedy decoding steps
from position C in one jitted `lax.scan`, timed after compilation (median of
--repeats). Reported: decode tokens/s, milliseconds per token, cache bytes
(every layer's keys, values and state) and the prefill time. A model whose
cache or prefill does not fit in --max_cache_gb is reported as such, not run.
Untrained weights: speed and memory do not depend on them.

With --batch_sizes, the batch sweep instead: for each model, context C and batch size B, B random
prompts of C - 1 tokens continued by `generation.generate_batch` (greedy, --new_tokens each, no
early stop: the library's whole path), timed after compilation, side by side: --repeats rounds,
each calling every batch size once in turn (a change in the machine's load falls on all sizes
alike), medians over the rounds. Reported: decoding tokens/s (B x the decoding steps / the
seconds of the decoding calls, which `generate_batch` times with `timings=`; the batched prefill
of the prompts is timed apart, as prefill_s, and the whole call as call_s), milliseconds per
step, the speed-up over the first batch size (the ratio of the medians, "vs B=1", and the median
of the rounds' own ratios, "by round") and the cache bytes per row (the cache pytree's bytes /
B), also for a context of 16 C (shapes only): constant for the local models, growing with C for
the dense baseline. --trace_dir adds one round, after the timed ones, under `jax.profiler.trace`
(the per-thunk times of a decoding call). With --out it is written under "batch_sweep" in the
JSON file, whose other content (the context sweep's "args" and "rows") is kept, and the reverse.

    python -m experiments.bench_decode --batch_sizes=1,8,32 --contexts=256 --new_tokens=32 \
        --configs=configs/dense.py,configs/sliding_window.py,configs/pi_attention.py,configs/bcmt.py,configs/ecp.py \
        --d_model=256 --num_layers=2 --num_heads=4 --vocab_size=16384 --out=experiments/results/decode.json
"""

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from efficient_lm import models
from efficient_lm.inference import generation
from experiments.common import build, load_config


def cache_bytes(cache) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))


def model_for(spec: str, args) -> tuple[nnx.Module, str]:
  config = load_config(spec)
  config.data.vocab_size = args.vocab_size  # the model's follows (`build`)
  for field in ("d_model", "num_layers", "num_heads"):
    config.model[field] = getattr(args, field)
  cfg = build(config).model
  return models.create(cfg, rngs=nnx.Rngs(0)), cfg.name


def bench(model: nnx.Module, name: str, context: int, args) -> dict:
  """Prefill `context` tokens, then time `args.new_tokens` decoding steps."""
  total = context + args.new_tokens
  abstract_cache = jax.eval_shape(lambda: model.init_cache(1, total))
  row = {"context": context, "cache_bytes": cache_bytes(abstract_cache)}
  if row["cache_bytes"] > args.max_cache_gb * 2 ** 30:
    return dict(row, skipped=f"cache over {args.max_cache_gb} GiB")
  graphdef, params = nnx.split(model)
  chunk = args.prefill_chunk if name in args.chunked_prefill.split(",") else None

  @jax.jit
  def prefill(params, tokens_BT):
    model = nnx.merge(graphdef, params)
    logits_BV, cache = generation.prefill(model, tokens_BT, model.init_cache(1, total), chunk)
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), cache

  @jax.jit
  def decode(params, token_B, cache):
    def body(carry, i):
      params, cache, token_B = carry
      logits_BV, cache = nnx.merge(graphdef, params).decode_step(token_B, cache, context + i)
      token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
      return (params, cache, token_B), token_B

    (_, cache, _), tokens_NB = jax.lax.scan(body, (params, cache, token_B),
                                            jnp.arange(args.new_tokens))
    return tokens_NB

  tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, args.vocab_size, (1, context)),
                          jnp.int32)
  start = time.perf_counter()
  token_B, cache = jax.block_until_ready(prefill(params, tokens_BT))
  row["prefill_s_with_compile"] = time.perf_counter() - start
  jax.block_until_ready(decode(params, token_B, cache))  # compile
  times = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    jax.block_until_ready(decode(params, token_B, cache))
    times.append(time.perf_counter() - start)
  seconds = statistics.median(times)
  return dict(row, ms_per_token=1e3 * seconds / args.new_tokens,
              decode_tokens_per_sec=args.new_tokens / seconds)


def batch_runner(model: nnx.Module, context: int, batch_size: int, args) -> tuple[dict, object]:
  """(the row's sizes, a function timing one `generation.generate_batch` call of `batch_size`
  prompts of context - 1 tokens (the end-of-document token makes C), --new_tokens each, greedy and
  never stopping early, or None when the cache does not fit): the call compiled already."""
  total = context + args.new_tokens
  abstract_cache = jax.eval_shape(lambda: model.init_cache(batch_size, total))
  far_cache = jax.eval_shape(lambda: model.init_cache(batch_size, 16 * context + args.new_tokens))
  row = {"context": context, "batch_size": batch_size,
         "cache_bytes_per_row": cache_bytes(abstract_cache) / batch_size,
         "cache_bytes_per_row_at_16x_context": cache_bytes(far_cache) / batch_size}
  if cache_bytes(abstract_cache) > args.max_cache_gb * 2 ** 30:
    return dict(row, skipped=f"cache over {args.max_cache_gb} GiB"), None
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, args.vocab_size, context - 1)) for _ in range(batch_size)]

  def run() -> tuple[float, dict]:
    timings = {}
    start = time.perf_counter()
    out = generation.generate_batch(
        model, prompts, num_tokens=args.new_tokens, eos_id=2, temperature=0.0, stop_ids=(),
        steps_per_call=args.new_tokens, timings=timings)
    seconds = time.perf_counter() - start
    assert all(len(ids) == args.new_tokens for ids in out)
    assert timings["steps"] == args.new_tokens - 1
    return seconds, timings

  start = time.perf_counter()
  run()
  row["first_call_s_with_compile"] = time.perf_counter() - start
  return row, run


def bench_batches(model: nnx.Module, context: int, batch_sizes: list[int], args) -> list[dict]:
  """One row per batch size: every size's call compiled first, then --repeats rounds in which
  each size is called once, in turn, so that a change in the machine's load falls on every size
  alike (the ratios between sizes are side by side); medians over the rounds."""
  prepared = [batch_runner(model, context, batch_size, args) for batch_size in batch_sizes]
  samples = [[] for _ in prepared]
  for _ in range(args.repeats):
    for (_, run), calls in zip(prepared, samples):
      if run is not None:
        calls.append(run())
  if args.trace_dir:  # one more round, traced (not in the medians)
    with jax.profiler.trace(args.trace_dir):
      for row, run in prepared:
        if run is not None:
          with jax.profiler.TraceAnnotation(f"batch_{row['batch_size']}"):
            run()
  rows = []
  for (row, run), calls in zip(prepared, samples):
    if run is not None:
      median = lambda key: statistics.median(timings[key] for _, timings in calls)
      steps = args.new_tokens - 1
      row = dict(row, call_s=statistics.median(seconds for seconds, _ in calls),
                 prefill_s=median("prefill_s"), decode_s=median("decode_s"),
                 ms_per_step=1e3 * median("decode_s") / steps,
                 tokens_per_sec=row["batch_size"] * steps / median("decode_s"),
                 decode_s_rounds=[timings["decode_s"] for _, timings in calls])
    rows.append(row)
  return rows


def write_section(path: str, section: dict) -> None:
  """Writes `section`'s keys into the JSON object at `path`, keeping its other keys."""
  data = {}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  data.update(section)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=2)
    f.write("\n")


def main_batch(args) -> None:
  """The batch sweep (module docstring)."""
  rows = []
  print(f"{'model':<28}{'context':>8}{'batch':>6}{'tok/s':>10}{'ms/step':>9}{'vs B=1':>8}"
        f"{'by round':>9}"
        f"{'prefill s':>10}"
        f"{'cache KiB/row':>15}{'at 16 C':>10}{'1st call s':>11}", flush=True)
  for spec in args.configs.split(","):
    model, _ = model_for(spec, args)
    for context in [int(c) for c in args.contexts.split(",")]:
      single = None
      for row in bench_batches(model, context, [int(b) for b in args.batch_sizes.split(",")], args):
        row = dict(row, config=spec)
        rows.append(row)
        batch_size = row["batch_size"]
        if "skipped" in row:
          print(f"{spec:<28}{context:>8}{batch_size:>6}  {row['skipped']}", flush=True)
          continue
        single = single or row
        row["speedup_vs_first_batch"] = row["tokens_per_sec"] / single["tokens_per_sec"]
        # The same ratio round by round (each round's two calls back to back), and its median.
        row["speedup_by_round"] = [batch_size * first / (single["batch_size"] * seconds)
                                   for seconds, first in zip(row["decode_s_rounds"],
                                                             single["decode_s_rounds"])]
        print(f"{spec:<28}{context:>8}{batch_size:>6}{row['tokens_per_sec']:>10.1f}"
              f"{row['ms_per_step']:>9.2f}{row['speedup_vs_first_batch']:>8.2f}"
              f"{statistics.median(row['speedup_by_round']):>9.2f}"
              f"{row['prefill_s']:>10.3f}"
              f"{row['cache_bytes_per_row'] / 2 ** 10:>15.1f}"
              f"{row['cache_bytes_per_row_at_16x_context'] / 2 ** 10:>10.1f}"
              f"{row['first_call_s_with_compile']:>11.1f}",
              flush=True)
  if args.out:
    write_section(args.out, {"batch_sweep": {"args": vars(args), "rows": rows}})


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--configs", default="configs/dense.py,configs/sliding_window.py,"
                      "configs/pi_attention.py,configs/bcmt.py")
  parser.add_argument("--contexts", default="2048,8192,32768")
  parser.add_argument("--d_model", type=int, default=256)
  parser.add_argument("--num_layers", type=int, default=4)
  parser.add_argument("--num_heads", type=int, default=4)
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--prefill_chunk", type=int, default=1024)
  parser.add_argument("--chunked_prefill", default="dense",
                      help="models (model.name) prefilled in chunks; the others in one pass")
  parser.add_argument("--max_cache_gb", type=float, default=8.0)
  parser.add_argument("--batch_sizes", default="",
                      help="the batch sweep at these batch sizes (e.g. 1,8,32); empty: the context sweep")
  parser.add_argument("--out", default=None, help="also write the rows as JSON here")
  parser.add_argument("--trace_dir", default="",
                      help="batch sweep: a jax.profiler trace of one more round, written here "
                      "(read it in TensorBoard's profile plugin or Perfetto: each thunk's time)")
  args = parser.parse_args()
  if args.batch_sizes:
    main_batch(args)
    return

  rows = []
  print(f"{'model':<28}{'context':>8}{'tok/s':>9}{'ms/tok':>9}{'cache MiB':>11}{'prefill s':>11}"
        f"{'ms/tok vs first C':>19}", flush=True)
  for spec in args.configs.split(","):
    model, name = model_for(spec, args)
    first_ms = None
    for context in [int(c) for c in args.contexts.split(",")]:
      row = dict(bench(model, name, context, args), config=spec)
      rows.append(row)
      if "skipped" in row:
        print(f"{spec:<28}{context:>8}  {row['skipped']}", flush=True)
        continue
      first_ms = first_ms or row["ms_per_token"]
      print(f"{spec:<28}{context:>8}{row['decode_tokens_per_sec']:>9.1f}{row['ms_per_token']:>9.2f}"
            f"{row['cache_bytes'] / 2 ** 20:>11.1f}{row['prefill_s_with_compile']:>11.1f}"
            f"{row['ms_per_token'] / first_ms:>19.2f}", flush=True)
  if args.out:
    write_section(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
  main()
