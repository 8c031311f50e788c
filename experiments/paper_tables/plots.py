"""The per-position figures: loss against window position, and each model minus the baseline."""

import math
import statistics

from experiments.paper_tables.render import curve_of, grouped
from experiments.paper_tables.specs import TABLES

def position_bins(T: int) -> list[tuple[int, int]]:
  """Half-octave bins of window positions: [0, 1), [1, 2), [2, 3), [3, 4), [4, 6), ... up to T."""
  edges = sorted({0, T} | {int(round(2 ** (k / 2))) for k in range(int(2 * math.log2(T)) + 1)})
  return [(lo, hi) for lo, hi in zip(edges, edges[1:]) if lo < T]


def mean_curve(per_positions: list[dict]) -> list[float]:
  """Per-position loss averaged over seeds (positions every seed scored)."""
  length = len(per_positions[0]["loss"])
  out = []
  for p in range(length):
    values = [pp["loss"][p] for pp in per_positions if pp["count"][p]]
    out.append(statistics.fmean(values) if len(values) == len(per_positions) else float("nan"))
  return out


def binned(curve: list[float], counts: list[int], bins) -> tuple[list[float], list[float]]:
  xs, ys = [], []
  for lo, hi in bins:
    ps = [p for p in range(lo, hi) if counts[p] and not math.isnan(curve[p])]
    if ps:
      n = sum(counts[p] for p in ps)
      xs.append(sum((p + 1) * counts[p] for p in ps) / n)
      ys.append(sum(curve[p] * counts[p] for p in ps) / n)
  return xs, ys


def plot_positions(table: str, rows: dict, positions: dict, path: str) -> bool:
  """Two panels, every model of the table, mean over seeds: validation loss against window
  position (half-octave bins, log scale), and each model's loss minus the table's baseline's at
  the same positions (same tokens, so what the token mix adds cancels; bins of `diff_bin`
  positions, linear scale, where block starts and the window's reach show)."""
  groups = [(k, [r for r in rs if r["key"] in positions]) for k, rs in grouped(rows, table)]
  groups = [(k, rs) for k, rs in groups if rs]
  if not groups:
    return False
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  spec = TABLES[table]
  curves = {}
  for config_key, rs in groups:
    pps = [curve_of(positions[r["key"]]) for r in rs]
    curves[config_key] = (mean_curve(pps), pps[0]["count"], len(rs))
  T = len(next(iter(curves.values()))[0])
  base = curves.get(spec["baseline"])
  step = spec.get("diff_bin", max(1, T // 64))
  linear_bins = [(lo, min(lo + step, T)) for lo in range(0, T, step)]
  fig, (ax, dax) = plt.subplots(2, 1, figsize=(8, 8), gridspec_kw={"height_ratios": [3, 2]})
  for config_key, (curve, counts, n) in curves.items():
    xs, ys = binned(curve, counts, position_bins(T))
    line, = ax.plot(xs, ys, marker=".", lw=1.2, label=f"{config_key} ({n} seed{'s' if n > 1 else ''})")
    if base is not None:
      dxs, dys = binned([c - b for c, b in zip(curve, base[0])], counts, linear_bins)
      dax.plot([x - 1 for x in dxs], dys, lw=1.2, color=line.get_color())
  for name, where in spec.get("marks", {}).items():
    for at in where:
      ax.axvline(at + 1, color="gray", ls=":", lw=1)
      dax.axvline(at, color="gray", ls=":", lw=1)
    ax.text(where[0] + 1, ax.get_ylim()[1], f" {name}", va="top", fontsize=8, color="gray", rotation=90)
  ax.set_xscale("log")
  ax.set_ylabel("validation loss (nats/token)")
  ax.set_xlabel("position in the window + 1 (log scale)")
  ax.set_title(f"{spec['title']}\nvalidation loss against position (context {T}; 4 window offsets "
               "pooled; mean over seeds)", fontsize=9)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, which="both")
  dax.axhline(0, color="black", lw=0.8)
  dax.set_xlim(0, T)
  dax.set_ylabel(f"loss minus {spec['baseline']}'s")
  dax.set_xlabel(f"position in the window (bins of {step})")
  dax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True
