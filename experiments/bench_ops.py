"""Times attention ops, forward + backward, against T: the linear-vs-quadratic check.

    python -m experiments.bench_ops --ops=causal,block_local:256,sliding:256,pi:256:512:4 \
        --seq_lens=2048,4096,16384 --repeats=5

Each op runs jitted on random `[B, T, H, K]` inputs (B=1, H=4, K=64 by default);
the figure is the median wall time of `repeats` calls after compilation. The
table also gives each time over the op's time at the smallest T (linear growth
doubles it per doubling of T) and, at each T, over `causal` at that T.
Measured side by side in one process, so the ratios are meaningful on a noisy
machine even when the absolute times are not. Ops that do not fit (causal at
long T) can be limited with --max_causal_len.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from efficient_lm.ops import attention


def make_op(spec: str):
  """'causal' | 'block_local:L[:lookback]' | 'sliding:W' | 'pi:W:P:S' -> f(q, k, v)."""
  name, *args = spec.split(":")
  nums = [int(a) for a in args]
  if name == "causal":
    return attention.causal_attention
  if name == "block_local":
    return lambda q, k, v: attention.block_local_attention(
        q, k, v, block_size=nums[0], lookback=nums[1] if len(nums) > 1 else 0)
  if name == "sliding":
    return lambda q, k, v: attention.sliding_window_attention(q, k, v, window=nums[0])
  if name == "pi":
    def pi(q, k, v):
      gate = jnp.full(q.shape[:3], 0.5, q.dtype)
      return attention.pi_attention(q, k, v, gate, window=nums[0], period=nums[1], num_skips=nums[2])
    return pi
  raise ValueError(f"unknown op spec {spec!r}")


def time_fwd_bwd(op, T: int, *, batch: int, heads: int, head_dim: int, repeats: int) -> float:
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (batch, T, heads, head_dim), jnp.float32) for key in keys)
  step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(op(q, k, v) ** 2), argnums=(0, 1, 2)))
  jax.block_until_ready(step(q, k, v))  # compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(step(q, k, v))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--ops", default="causal,block_local:256,sliding:256,pi:256:512:4")
  parser.add_argument("--seq_lens", default="2048,4096,16384")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--max_causal_len", type=int, default=8192)
  parser.add_argument("--json", default="", help="also write the results to this file")
  args = parser.parse_args()
  specs = args.ops.split(",")
  seq_lens = [int(t) for t in args.seq_lens.split(",")]
  results = {}
  for spec in specs:
    for T in seq_lens:
      if spec == "causal" and T > args.max_causal_len:
        continue
      results[(spec, T)] = time_fwd_bwd(make_op(spec), T, batch=args.batch, heads=args.heads,
                                        head_dim=args.head_dim, repeats=args.repeats)
      print(f"{spec:>20} T={T:>6}: {1e3 * results[(spec, T)]:9.1f} ms", flush=True)
  print(f"\nfwd+bwd median of {args.repeats}, B={args.batch} H={args.heads} K={args.head_dim}\n")
  print(f"| op | T | ms | vs T={seq_lens[0]} | causal / op |")
  print("| --- | --- | --- | --- | --- |")
  for (spec, T), seconds in results.items():
    base = results.get((spec, seq_lens[0]))
    causal = results.get(("causal", T))
    print(f"| {spec} | {T} | {1e3 * seconds:.1f} | {seconds / base:.2f} | "
          f"{'' if causal is None else f'{causal / seconds:.2f}'} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump([{"op": s, "seq_len": T, "seconds": v} for (s, T), v in results.items()], f, indent=1)


if __name__ == "__main__":
  main()
