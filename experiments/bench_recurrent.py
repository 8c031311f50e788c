"""Times the gated delta rule (`ops.recurrent.gated_delta_rule`), forward + backward, against T:
the check that its time grows linearly in T.

    python -m experiments.bench_recurrent --seq_lens=4096,8192,16384,32768 --repeats=5

Each T runs jitted `jax.grad` of the sum of the outputs and the final state with respect to q, k,
v, g and beta on random inputs (B=1, H=4, K=V=64 by default; k L2-normalised, g = log sigmoid,
beta = sigmoid, as a model feeds them), chunks of --chunk_size. The calls are interleaved: each
round times one call at every T in turn, so a load spike on this shared machine hits every T
alike; the figure is the median over --repeats rounds after compilation. The table gives each
median, its time per token, and its ratio to the previous T (2.0 per doubling is linear, 4.0
quadratic). --json writes the rows.
"""

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp

from efficient_lm.ops import recurrent
from experiments.common import write_json


def step_for(T: int, args):
  """A compiled fwd+bwd of the op at length T, and its inputs."""
  keys = jax.random.split(jax.random.key(T), 5)
  B, H, K, V = args.batch_size, args.heads, args.head_dim, args.head_dim
  q = jax.random.normal(keys[0], (B, T, H, K))
  k = jax.random.normal(keys[1], (B, T, H, K))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jax.random.normal(keys[2], (B, T, H, V))
  g = jax.nn.log_sigmoid(jax.random.normal(keys[3], (B, T, H)) + 3.0)
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H)))
  op = functools.partial(recurrent.gated_delta_rule, chunk_size=args.chunk_size, impl=args.impl)

  def loss(*inputs):
    o, final = op(*inputs)
    return jnp.sum(o) + jnp.sum(final)

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  inputs = (q, k, v, g, beta)
  jax.block_until_ready(step(*inputs))  # compile and warm up
  return step, inputs


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seq_lens", default="4096,8192,16384,32768")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--batch_size", type=int, default=1)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--chunk_size", type=int, default=64)
  parser.add_argument("--impl", default="xla")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  seq_lens = [int(t) for t in args.seq_lens.split(",")]
  steps = {T: step_for(T, args) for T in seq_lens}
  times = {T: [] for T in seq_lens}
  for _ in range(args.repeats):
    for T, (step, inputs) in steps.items():
      start = time.perf_counter()
      jax.block_until_ready(step(*inputs))
      times[T].append(time.perf_counter() - start)
  rows, previous = [], None
  print(f"{'T':>7} {'median s':>9} {'us/token':>9} {'x prev T':>9}")
  for T in seq_lens:
    median = statistics.median(times[T])
    ratio = None if previous is None else median / previous
    rows.append({"T": T, "median_seconds": median, "seconds": times[T],
                 "us_per_token": 1e6 * median / T, "over_previous_T": ratio})
    print(f"{T:>7} {median:>9.3f} {1e6 * median / T:>9.2f} "
          f"{'' if ratio is None else f'{ratio:.2f}':>9}")
    previous = median
  if args.json:
    write_json(args.json, {"command": "python -m experiments.bench_recurrent "
                                      + " ".join(argv or []), "args": vars(args), "rows": rows})


if __name__ == "__main__":
  main()
