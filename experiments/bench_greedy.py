"""The next-token choice of a greedy decoding step, after the tied head, side by side.

    python -m experiments.bench_greedy --batch_sizes=1,8,32 --vocab_size=16384 --d_model=256 \
        --out=experiments/results/greedy.json

For each batch size B: a model's final hidden states `[B, 1, D]` (random) through its head
(`LanguageModel.logits`, which computes a few rows vocabulary-major on CPU) and then one of the
ways to pick each row's token, jitted as one function:

  head          the head alone (its `[B, V]` logits returned)
  greedy        `generation.greedy` (two levels: block maxima, then one block a row)
  flat_search   one level: the maximum, then the first index holding it over the whole `[V, B]`
                (what `greedy` was before the two levels)
  argmax        `jnp.argmax` (XLA's paired value-and-index reduction)

Each function is compiled first, and the three choices are checked to pick the same tokens;
then --rounds rounds, each calling every function --calls times in turn (a change in the
machine's load falls on all of them alike). Reported per function: the median over the rounds of
the milliseconds a call, and what it costs over `greedy` (the median of the rounds' own
differences). The head alone is a reference, not a baseline to subtract: returning its logits
writes a `[B, V]` array that the fused choices never write. Untrained weights: speed does not
depend on them.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from efficient_lm.inference import generation
from experiments import bench_decode


def flat_search(logits_BV: jax.Array) -> jax.Array:
  """The first maximum of each row (the first NaN if any) in one level over the whole
  vocabulary: a broadcast maximum, a compare and an index array the vocabulary's size."""
  logits_VB = logits_BV.T
  V = logits_VB.shape[0]
  max_1B = jnp.max(logits_VB, axis=0, keepdims=True)
  index_VB = jax.lax.broadcasted_iota(jnp.int32, logits_VB.shape, 0)
  hit_VB = (logits_VB == max_1B) | jnp.isnan(logits_VB)
  return jnp.min(jnp.where(hit_VB, index_VB, V), axis=0).astype(jnp.int32)


CHOICES = {
    "head": None,
    "greedy": generation.greedy,
    "flat_search": flat_search,
    "argmax": lambda logits_BV: jnp.argmax(logits_BV, axis=-1).astype(jnp.int32),
}


OTHERS = ("flat_search", "argmax")  # compared with greedy


def compiled(model: nnx.Module, choose):
  """`f(params, x_B1D)`: the head, then `choose` (None: the logits themselves), jitted."""
  graphdef, params = nnx.split(model)

  @jax.jit
  def f(params, x_B1D):
    logits_BV = nnx.merge(graphdef, params).logits(x_B1D)[:, 0]
    return logits_BV if choose is None else choose(logits_BV)

  return lambda x_B1D: f(params, x_B1D)


def bench(model: nnx.Module, batch_size: int, args) -> dict:
  """Milliseconds a call of each way (module docstring), in rounds; the choices checked equal."""
  x_B1D = jnp.asarray(np.random.default_rng(batch_size).normal(
      size=(batch_size, 1, args.d_model)), jnp.float32)
  calls = {name: compiled(model, choose) for name, choose in CHOICES.items()}
  picked = {name: np.asarray(jax.block_until_ready(f(x_B1D))) for name, f in calls.items()}
  for name in ("greedy", "flat_search"):  # the same tokens as argmax, or the timing means nothing
    np.testing.assert_array_equal(picked[name], picked["argmax"], err_msg=name)
  rounds = {name: [] for name in calls}
  for _ in range(args.rounds):
    for name, f in calls.items():
      start = time.perf_counter()
      for _ in range(args.calls):
        out = f(x_B1D)
      jax.block_until_ready(out)
      rounds[name].append(1e3 * (time.perf_counter() - start) / args.calls)
  row = {"batch_size": batch_size}
  for name, times in rounds.items():
    row[f"{name}_ms"] = statistics.median(times)
  for name in OTHERS:
    row[f"{name}_over_greedy_ms"] = statistics.median(
        t - ours for t, ours in zip(rounds[name], rounds["greedy"]))
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/pi_attention.py")
  parser.add_argument("--batch_sizes", default="1,8,32")
  parser.add_argument("--vocab_size", type=int, default=16384)
  parser.add_argument("--d_model", type=int, default=256)
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--calls", type=int, default=200, help="calls a function makes in a round")
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  # The head alone matters here: bench_decode's model, with the fewest layers its fields allow.
  args.num_layers, args.num_heads = 1, 4
  model, _ = bench_decode.model_for(args.config, args)
  rows = []
  print(f"{'batch':>6}" + "".join(f"{name + ' ms':>16}" for name in CHOICES)
        + "".join(f"{name + ' - greedy':>22}" for name in OTHERS), flush=True)
  for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
    row = bench(model, batch_size, args)
    rows.append(row)
    print(f"{batch_size:>6}" + "".join(f"{row[name + '_ms']:>16.3f}" for name in CHOICES)
          + "".join(f"{row[name + '_over_greedy_ms']:>22.3f}" for name in OTHERS),
          flush=True)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump({"args": vars(args), "device": jax.devices()[0].device_kind, "rows": rows}, f,
                indent=2)
      f.write("\n")


if __name__ == "__main__":
  main()
