"""Where a Gated DeltaNet train step spends its time, beside dense's, in one run.

    python -m experiments.gdn_step_parts --seq_len=16384

Six train steps (forward, backward, AdamW; `bench_step.compile_train_step`), B=1, d_model 256, 4
layers, 4 heads, vocabulary 8192, each config's own fields otherwise, every one compiled first and
then timed side by side: one warm-up step each, then --repeats rounds of one step of every row in
turn (so that a drifting load moves every row alike), the median per row:

  dense          configs/dense.py (flash attention: O(T) memory, O(T^2) time)
  gdn            configs/gated_deltanet.py as it trains (its blocks over sequence chunks of its
                 `model.seq_chunk` tokens, the state carried)
  gdn, seq_chunk 8192   the same in chunks of 8,192 tokens (the other families' chunk)
  gdn, whole     the same with model.seq_chunk=0: every block over the whole sequence at once
  gdn, no rule   configs/gated_deltanet.py with the gated delta rule replaced by an elementwise
                 stand-in (o = v (q.k + g), no state): what the projections, the short
                 convolution, the MLPs and the vocabulary head cost around the recurrence
  gdn, no rule, no conv   and with model.conv_size=1 (the convolution one tap wide)

The stand-in rows are a measurement of the parts, not a model: nothing trains with them. Writes
experiments/results/gdn_step_parts.json (--out) with the command and the machine's load.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys

import jax.numpy as jnp

from efficient_lm.ops import recurrent
from experiments import bench_step
from experiments.common import REPO, build, load_config

# (row, config file, model fields, the rule stood in for)
ROWS = (("dense", "configs/dense.py", {}, False),
        ("gdn", "configs/gated_deltanet.py", {}, False),
        ("gdn, seq_chunk 8192", "configs/gated_deltanet.py", {"seq_chunk": 8192}, False),
        ("gdn, whole", "configs/gated_deltanet.py", {"seq_chunk": 0}, False),
        ("gdn, no rule", "configs/gated_deltanet.py", {}, True),
        ("gdn, no rule, no conv", "configs/gated_deltanet.py", {"conv_size": 1}, True))


def _stand_in(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, **unused):
  """Elementwise in place of the rule: every input used, no state carried."""
  del unused
  B, _, H, K = q_BTHK.shape
  o_BTHV = v_BTHV * (jnp.sum(q_BTHK * k_BTHK, -1, keepdims=True) + (g_BTH + beta_BTH)[..., None])
  return o_BTHV, jnp.zeros((B, H, K, v_BTHV.shape[-1]), jnp.float32)


@contextlib.contextmanager
def _swapped(module, name: str, replacement, active: bool):
  saved = getattr(module, name)
  if active:
    setattr(module, name, replacement)
  try:
    yield
  finally:
    setattr(module, name, saved)


def compile_row(spec: str, model: dict, stand_in: bool, args):
  config = load_config(spec)
  config.data.seq_len, config.data.batch_size, config.data.vocab_size = args.seq_len, 1, args.vocab_size
  config.model.d_model, config.model.num_layers, config.model.num_heads = args.d_model, 4, 4
  for field, value in model.items():
    config.model[field] = value
  with _swapped(recurrent, "gated_delta_rule", _stand_in, stand_in):
    compiled, state, batch, _, _ = bench_step.compile_train_step(build(config))
  return compiled, state, batch


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seq_len", type=int, default=16384)
  parser.add_argument("--d_model", type=int, default=256)
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default=os.path.join(REPO, "experiments", "results", "gdn_step_parts.json"))
  args = parser.parse_args()
  steps = {}
  for name, spec, model, stand_in in ROWS:
    print(f"compiling {name}...", flush=True)
    steps[name] = list(compile_row(spec, model, stand_in, args))
  load_before = os.getloadavg()[0]
  times = bench_step.time_interleaved(steps, args.repeats)
  rows = [{"row": name, "step_seconds": statistics.median(t), "times": t,
           "tokens_per_sec": args.seq_len / statistics.median(t)} for name, t in times.items()]
  dense = rows[0]["step_seconds"]
  print(f"\nT={args.seq_len}, B=1, d_model {args.d_model}, 4 layers, 4 heads, vocabulary "
        f"{args.vocab_size}; median of {args.repeats} interleaved steps\n")
  print("| row | s a step | dense's time / this |")
  print("| --- | --- | --- |")
  for r in rows:
    r["dense_over_this"] = dense / r["step_seconds"]
    print(f"| {r['row']} | {r['step_seconds']:.2f} | {r['dense_over_this']:.2f} |")
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump({"command": " ".join(["python -m experiments.gdn_step_parts", *sys.argv[1:]]),
                 "settings": vars(args), "interleaved": True, "load_before": load_before,
                 "load_after": os.getloadavg()[0], "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
