"""How a decided claim reads, for `experiments.verdicts` (which decides them) and
`experiments.paper_tables.render` (which lists a table's claims): the labels beyond
`efficient_lm.stats`'s verdicts, a verdicts.json's rows by claim, and a row's verdict cell."""

from efficient_lm import stats

EXPLORATORY = "exploratory"  # a result that ran before its claim was registered: never a verdict
NOT_VALIDATED = "not validated"  # a swap claim whose rows the placebo gate does not validate


def by_claim(verdicts: dict) -> dict[str, dict]:
  return {r["claim"]: r for r in verdicts["rows"] + verdicts["pending"]}


def verdict_cell(row: dict) -> str:
  v = row["verdict"]
  if row["note"].startswith("pending"):
    return f"not decided ({row['note']})"
  if v in (EXPLORATORY, NOT_VALIDATED):
    return f"{v} ({row['note']})"
  if row.get("ahead"):  # a registered claim: which arm its verdict puts ahead
    return f"**{v}** ({row['ahead']} ahead)"
  return f"**{v}**" if v not in (stats.NOT_DECIDED, stats.NOT_COMPARABLE) else (
      f"{v} ({row['note']})" if row["note"] else v)
