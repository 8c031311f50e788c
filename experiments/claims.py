"""How a decided claim reads, for `experiments.verdicts` (which decides them) and
`experiments.paper_tables.render` (which lists a table's claims): the labels beyond
`efficient_lm.evaluation.stats`'s verdicts, a verdicts.json's rows by claim, and a row's verdict cell."""

from efficient_lm.evaluation import stats

EXPLORATORY = "exploratory"  # a result that ran before its claim was registered: never a verdict
NOT_VALIDATED = "not validated"  # a swap claim whose rows the placebo gate does not validate
# A registered two-sided difference decided either way: the arms differ, and the row names the
# one ahead (stats' own labels read from A's side: "refuted" for "B ahead" reads as "no").
DIFFER = "differ"

# What a registered claim's test measured, where its registered text (never edited after its
# registration) says more than that: shown beside the text wherever the claim is reported.
MEASURED = {
    "needle_pi_past_window": (
        "carrying the one value a haystack holds past the window's reach: top-1 of the true value "
        "among 10, of which only it is in the prompt; no other key's value is there to tell apart, "
        "so this is copying one value, not looking a key up"),
    "needle_bcmt_past_block": (
        "carrying the one value past BCMT's block, against HOnly, which did not learn the task "
        "even inside its own block (near needles at chance): the memory against no retrieval at "
        "all, an arm the recall claims' trained precondition would call not comparable"),
    "needle_ecp_vs_perceiver": (
        "top-1 over the whole grid at 2 layers, where ECP's attention has no path to the needles "
        "past its two pieces: its deficit on the far half is built in, not found"),
    "needle_pi_past_window_exact": (
        "exact match, 0 in every row by construction: `loss=answer` never weights the target "
        "after a value's last digit, so no model learns where a value ends"),
    "needle_bcmt_past_block_exact": "exact match, 0 in every row by construction (as above)",
    "needle_ecp_vs_perceiver_exact": "exact match, 0 in every row by construction (as above)",
    "mqar_bcmt_past_block": (
        "BCMT's memory against an arm with no path to any pair (HOnly at chance by construction): "
        "whether the memory carries pairs across blocks at all"),
}


def by_claim(verdicts: dict) -> dict[str, dict]:
  return {r["claim"]: r for r in verdicts["rows"] + verdicts["pending"]}


def verdict_cell(row: dict) -> str:
  v = row["verdict"]
  if row["note"].startswith("pending"):
    return f"not decided ({row['note']})"
  if v in (EXPLORATORY, NOT_VALIDATED):
    return f"{v} ({row['note']})"
  if row.get("ahead"):  # a registered claim: which arm its verdict puts ahead
    if v == DIFFER:
      return f"**differ**, {row['ahead']} ahead"
    return f"**{v}** ({row['ahead']} ahead)"
  return f"**{v}**" if v not in (stats.NOT_DECIDED, stats.NOT_COMPARABLE) else (
      f"{v} ({row['note']})" if row["note"] else v)
