"""Long-range probe: can the model fetch a token seen d positions back? Accuracy against d, per model.

    nice -n 5 python -m experiments.retrieval_probe                  # dense, bcmt, sliding, π, π doubling
    python -m experiments.retrieval_probe --models=sliding_window,pi_attention --steps=200

The task: a window of T random filler tokens holds one value token (one of
--num_values, never used as filler) at distance d from the end; the last
input is a query token and the only trained and scored target is that value.
Retrieving it needs a path of attention from the last position back d
tokens, so accuracy against d shows where each attention pattern stops
reaching: a sliding window at about num_layers x window, π-Attention's skips
at multiples of the period (further with the doubling schedule), BCMT's
block-local attention at its block, beyond which only the exponentially
decaying memory of pooled block summaries can carry the value. Dense
attention is the reference. Chance is 1 / num_values.

Training draws d log-uniformly from 1..T-2 each example, with the train step
`efficient_lm.training.loop` uses (AdamW, the same loss with the weights on the last
position only); evaluation fixes d at each of --distances. Writes
<out_dir>/retrieval_probe.json and retrieval_probe.png.
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from efficient_lm.state import train_state
from efficient_lm.training import step as train_step
from experiments.common import REPO, build, load_config

MODELS = "dense,bcmt,sliding_window,pi_attention,pi_attention:doubling"


def config_spec(key: str) -> str:
  name, _, preset = key.partition(":")
  return f"configs/{name}.py" + (f":{preset}" if preset else "")


def probe_config(key: str, args):
  """The model's run at the probe's tiny size and local sizes (--block)."""
  config = load_config(config_spec(key))
  config.data.seq_len = args.seq_len
  config.data.batch_size = args.batch_size
  config.data.vocab_size = args.num_filler + args.num_values + 1
  m = config.model
  m.update(dict(d_model=args.d_model, num_layers=args.num_layers, num_heads=args.num_heads, mlp_ratio=2))
  preset = key.partition(":")[2]
  local = {"block_size": args.block, "window": args.block, "num_skips": args.num_skips,
           "period": args.block // 2 if preset == "doubling" else args.block}
  for field, value in local.items():
    if field in m:
      m[field] = value
  config.train.update(dict(num_steps=args.steps, learning_rate=args.learning_rate,
                           warmup_steps=max(1, args.steps // 10), weight_decay=0.0))
  return build(config)


def make_batch(rng: np.random.Generator, distances: np.ndarray, args) -> dict:
  """Filler, one value token at T-1-d in the inputs, the query last; the target is the value."""
  B, T = len(distances), args.seq_len
  inputs = rng.integers(0, args.num_filler, (B, T)).astype(np.int32)
  values = rng.integers(args.num_filler, args.num_filler + args.num_values, B).astype(np.int32)
  inputs[np.arange(B), T - 1 - distances] = values
  inputs[:, -1] = args.num_filler + args.num_values  # the query token
  targets = np.zeros((B, T), np.int32)
  targets[:, -1] = values
  weights = np.zeros((B, T), np.float32)
  weights[:, -1] = 1.0
  return {"inputs": inputs, "targets": targets, "weights": weights}


def train_distances(rng: np.random.Generator, args) -> np.ndarray:
  """d log-uniform in [1, T-2]: every scale of distance as common, so a model that can reach only
  short distances still sees enough of them to learn the retrieval it is capable of."""
  d = np.exp(rng.uniform(0.0, np.log(args.seq_len - 2), args.batch_size))
  return np.clip(np.round(d), 1, args.seq_len - 2).astype(np.int64)


def run_model(key: str, args) -> dict:
  config = probe_config(key, args)
  built = train_state.build(config, seed=args.seed)
  graphdef, state = built.graphdef, built.state
  step = train_step.make_train_step(graphdef, built.tx, built.schedule, seed=args.seed)
  rng = np.random.default_rng(args.seed)
  start = time.perf_counter()
  losses = []
  for _ in range(args.steps):
    distances = train_distances(rng, args)
    state, metrics = step(state, make_batch(rng, distances, args))
    losses.append(metrics["loss"])
  losses = [float(x) for x in jax.device_get(losses)]
  train_seconds = time.perf_counter() - start

  @jax.jit
  def predict(params, inputs):
    return jnp.argmax(nnx.merge(graphdef, params)(inputs)[:, -1], axis=-1)

  eval_rng = np.random.default_rng(args.seed + 1)
  accuracy = {}
  for d in args.distances:
    batch = make_batch(eval_rng, np.full(args.eval_examples, d), args)
    accuracy[d] = float(np.mean(np.asarray(predict(state.params, batch["inputs"])) == batch["targets"][:, -1]))
  return {"model": key, "model_name": config.model.name, "accuracy": accuracy,
          "final_train_loss": float(np.mean(losses[-10:])), "train_seconds": train_seconds,
          "local": {f: getattr(config.model, f) for f in ("block_size", "window", "period", "num_skips",
                                                          "period_schedule", "alpha")
                    if hasattr(config.model, f)}}


def plot(rows: list[dict], args, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for r in rows:
    ds = sorted(int(d) for d in r["accuracy"])
    ax.plot(ds, [r["accuracy"][d] for d in ds], "o-", label=r["model"])
  ax.axhline(1 / args.num_values, color="gray", ls=":", label="chance")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("distance d from the query (tokens)")
  ax.set_ylabel("retrieval accuracy")
  ax.set_title(f"T={args.seq_len}, d_model {args.d_model}, {args.num_layers} layers, block/window/period "
               f"{args.block}, {args.steps} steps", fontsize=9)
  ax.legend(fontsize=8)
  ax.grid(True, alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", default=MODELS)
  parser.add_argument("--seq_len", type=int, default=256)
  parser.add_argument("--d_model", type=int, default=32)
  parser.add_argument("--num_layers", type=int, default=2)
  parser.add_argument("--num_heads", type=int, default=2)
  parser.add_argument("--block", type=int, default=16, help="BCMT block, window and period (tokens)")
  parser.add_argument("--num_skips", type=int, default=3)
  parser.add_argument("--num_filler", type=int, default=32)
  parser.add_argument("--num_values", type=int, default=8)
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--learning_rate", type=float, default=1e-2)
  parser.add_argument("--eval_examples", type=int, default=128)
  parser.add_argument("--distances", default="4,8,15,24,32,48,64,96,128,192,254")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out_dir", default=os.path.join(REPO, "experiments", "results"))
  args = parser.parse_args()
  args.distances = [int(d) for d in args.distances.split(",")]
  if max(args.distances) > args.seq_len - 2:
    parser.error(f"--distances: {max(args.distances)} > seq_len - 2 = {args.seq_len - 2}; lower it or raise --seq_len")
  os.makedirs(args.out_dir, exist_ok=True)
  rows = []
  for key in args.models.split(","):
    rows.append(run_model(key, args))
    r = rows[-1]
    print(f"{key:>22}: " + " ".join(f"{d}:{r['accuracy'][d]:.2f}" for d in args.distances)
          + f"  (loss {r['final_train_loss']:.3f}, {r['train_seconds']:.0f} s)", flush=True)
  settings = {k: v for k, v in vars(args).items() if k not in ("out_dir",)}
  with open(os.path.join(args.out_dir, "retrieval_probe.json"), "w") as f:
    json.dump({"settings": settings, "chance": 1 / args.num_values, "rows": rows}, f, indent=1)
  plot(rows, args, os.path.join(args.out_dir, "retrieval_probe.png"))
  print("\n| model | " + " | ".join(f"d={d}" for d in args.distances) + " |")
  print("| --- |" + " --- |" * len(args.distances))
  for r in rows:
    print(f"| `{r['model']}` | " + " | ".join(f"{r['accuracy'][d]:.2f}" for d in args.distances) + " |")


if __name__ == "__main__":
  main()
