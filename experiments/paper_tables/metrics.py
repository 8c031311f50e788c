"""The numbers a table's rows give: per-position curves, band losses, rows grouped by config, and
a claim's metric per seed (`metric_values`), for the tables (`render`) and the claims
(`experiments.verdicts`)."""

from experiments.paper_tables.specs import TABLES, split_key


def curve_of(row_positions: dict) -> dict:
  """The row's per-position curve: pooled over the offsets where scored so, else offset 0's."""
  return row_positions.get("pooled") or row_positions["windows"]


def ranges_loss(per_position: dict, ranges) -> float:
  """Mean loss (weighted by scored tokens) over the positions of the (lo, hi) ranges."""
  loss, count = per_position["loss"], per_position["count"]
  where = [p for lo, hi in ranges for p in range(lo, min(hi, len(loss))) if count[p]]
  n = sum(count[p] for p in where)
  return sum(loss[p] * count[p] for p in where) / n if n else float("nan")


def band_loss(per_position: dict, lo: int, hi: int) -> float:
  return ranges_loss(per_position, ((lo, hi),))


def grouped(rows: dict, table: str) -> list[tuple[str, list[dict]]]:
  """(config key, its rows by seed) in the table's order, then any others."""
  by_key: dict[str, list[dict]] = {}
  for key in sorted(rows, key=lambda k: split_key(k)[1]):
    if "config_key" in rows[key]:
      by_key.setdefault(rows[key]["config_key"], []).append(rows[key])
  order = [k for k, _ in TABLES[table]["rows"] if k in by_key] + sorted(set(by_key) - {k for k, _ in
                                                                                      TABLES[table]["rows"]})
  return [(k, by_key[k]) for k in order]


def metric_values(rows: list[dict], metric: tuple, positions: dict) -> list[float] | None:
  """One value per seed row: ('eval',) the training eval's loss; ('latents',) the last-Z score;
  ('band', lo, hi) the per-position loss over positions lo..hi-1; ('gain', far, near) the loss over
  the `far` position ranges minus over the `near` ones. None while a row lacks its curve."""
  if metric[0] == "eval":
    return [r["eval_loss"] for r in rows]
  if metric[0] == "latents":
    return [r["scores"]["last_latents"]["loss"] for r in rows]
  if not all(r["key"] in positions for r in rows):
    return None
  curves = [curve_of(positions[r["key"]]) for r in rows]
  if metric[0] == "band":
    return [band_loss(c, metric[1], metric[2]) for c in curves]
  return [ranges_loss(c, metric[1]) - ranges_loss(c, metric[2]) for c in curves]
