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
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from efficient_lm import models
from efficient_lm import generation
from experiments.common import load_config


def cache_bytes(cache) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))


def model_for(spec: str, args) -> tuple[nnx.Module, str]:
  config = load_config(spec)
  cfg = config.model
  cfg.vocab_size = args.vocab_size
  for field in ("d_model", "num_layers", "num_heads"):
    cfg[field] = getattr(args, field)
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
  parser.add_argument("--out", default=None, help="also write the rows as JSON here")
  args = parser.parse_args()

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
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()
