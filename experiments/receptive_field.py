"""Which input positions can reach the last output of a π-Attention (or sliding-window) stack.

    python -m experiments.receptive_field --seq_len=8192 --window=128 --period=128 --num_skips=3 \
        --num_layers=4

Computed from the attention pattern alone: token i of a layer sees the offsets
0..window-1 (its window) and m * period (m = 1..num_skips, not inside the
window), and a stack composes them from the last layer down. The result is
compared with the paper's bound k * n_l + P * ceil(log2 n_l) (window k, period
P, n_l layers), for the constant and the doubling period schedule and for the
sliding-window baseline (num_skips=0). tests/test_receptive_field.py checks the
pattern against the gradients of a small model.
"""

import argparse
import math

import numpy as np


def layer_offsets(window: int, period: int, num_skips: int) -> list[int]:
  """Distances i - j that token i attends to: its window, then the skips outside it."""
  skips = [m * period for m in range(1, num_skips + 1) if m * period >= window]
  return list(range(window)) + skips


def layer_periods(period: int, schedule: str, num_layers: int) -> list[int]:
  return [period * 2 ** l if schedule == "doubling" else period for l in range(num_layers)]


def receptive_field(seq_len: int, *, window: int, period: int, num_skips: int, schedule: str,
                    num_layers: int) -> np.ndarray:
  """Bool `[seq_len]`: input positions with a path to the output at seq_len - 1."""
  reach = np.zeros(seq_len, bool)
  reach[-1] = True
  for layer_period in reversed(layer_periods(period, schedule, num_layers)):
    below = np.zeros(seq_len, bool)
    for d in layer_offsets(window, layer_period, num_skips):
      if d < seq_len:
        below[:seq_len - d] |= reach[d:]  # output i reaches input j = i - d
    reach = below
  return reach


def paper_bound(window: int, period: int, num_layers: int) -> int:
  return window * num_layers + period * math.ceil(math.log2(num_layers)) if num_layers > 1 else window


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seq_len", type=int, default=8192)
  parser.add_argument("--window", type=int, default=128)
  parser.add_argument("--period", type=int, default=128)
  parser.add_argument("--num_skips", type=int, default=3)
  parser.add_argument("--num_layers", type=int, default=4)
  args = parser.parse_args()
  print(f"T={args.seq_len} window={args.window} period={args.period} num_skips={args.num_skips} "
        f"layers={args.num_layers}; bound k*n_l + P*ceil(log2 n_l) = "
        f"{paper_bound(args.window, args.period, args.num_layers)}\n")
  print("| model | schedule | positions reached | farthest distance |")
  print("| --- | --- | --- | --- |")
  rows = [("sliding_window", "constant", 0), ("pi_attention", "constant", args.num_skips),
          ("pi_attention", "doubling", args.num_skips)]
  for name, schedule, skips in rows:
    reach = receptive_field(args.seq_len, window=args.window, period=args.period, num_skips=skips,
                            schedule=schedule, num_layers=args.num_layers)
    farthest = args.seq_len - 1 - int(np.argmax(reach))
    print(f"| {name} | {schedule} | {int(reach.sum())} | {farthest} |")


if __name__ == "__main__":
  main()
