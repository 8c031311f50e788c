"""The json files: the rows (`paper_tables.json`) and their per-position curves."""

import json
import os

def load_json(path: str, empty: dict) -> dict:
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  return empty


def save_json(results: dict, path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(results, f, indent=1, sort_keys=True)
  os.replace(tmp, path)



def save_compact(results: dict, path: str) -> None:
  """`results` ({table: {row: curves}}) one row per line: the per-position curves are long lists
  of numbers, which an indented dump writes one number per line."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  lines = []
  for table in sorted(results):
    rows = results[table]
    body = ",\n".join(f"  {json.dumps(key)}: {json.dumps(rows[key], sort_keys=True, separators=(',', ':'))}"
                      for key in sorted(rows))
    lines.append(f" {json.dumps(table)}: {{\n{body}\n }}")
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write("{\n" + ",\n".join(lines) + "\n}\n")
  os.replace(tmp, path)


def per_position_path(results_path: str) -> str:
  return os.path.splitext(results_path)[0] + "_per_position.json"
