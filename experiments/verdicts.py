"""Every claim, decided over training seeds by the rules of `efficient_lm.stats`, fixed before the runs.

    python -m experiments.verdicts     # results/verdicts.json and the READMEs' tables, from the results

The family (`family_size()` claims, listed here and in `paper_tables.specs.TABLES` before the runs):

  - recall (`RECALL_CLAIMS`, results/long_range.json): per seed, the run's accuracy over the
    queries at the claim's distances (for ECP, those its attention has a path to), 5 seeds;
  - the paper tables (`TABLES[...]['claims']`, results/paper_tables.json): per seed, the
    validation loss (or a per-position difference), 3 seeds;
  - the swap ablation (`ABLATION_MODELS` x corpora, results/context_ablation.json): per seed, the
    loss with the context beyond the cut swapped out minus the full loss, 3 seeds.

Each claim is a per-seed paired t ("A is better than B") or two one-sided tests ("A is comparable to
B" within `stats.EQUIVALENCE_MARGIN`), runs paired by `train.seed`; its verdict comes from its
Benjamini-Hochberg adjusted p-value over the whole family (`stats.decide_family`). A claim with
fewer seeds than planned is pending (listed under "pending", counted with p = 1), so a partial
verdicts.json is never less strict than the final one. The query bootstrap is kept as a per-run
description (`per_seed`), never a verdict.

Preconditions ("not comparable" whatever the numbers): recall claims need every run of both models
to recall at least `TRAINED` of the queries its own attention reaches in one hop (a model that
fails where it can reach is not trained, not refuted) and the same steps.
"""

import argparse
import json
import os

import numpy as np

from efficient_lm import stats
from experiments import long_range
from experiments.common import REPO
from experiments.context_ablation import CORPORA
from experiments.context_ablation import sanity_check

TRAINED = 0.5  # the share of queries inside its own reach a model must recall to be compared
RESULTS = os.path.join(REPO, "experiments", "results")
README = os.path.join(REPO, "experiments", "README.md")

# (claim, A, B, the distances it is judged on: [low, high), kind, only where A has a path).
# A query at distance d reads the pair's token d - 1 positions back: the window (W - 1 back) ends
# at d = W, the skips (m P back) reach d = S P + 1, one block or ECP's pair of pieces d = L.
W, P, S, L = long_range.W, long_range.P, long_range.S, long_range.L
RECALL_CLAIMS = [
    ("π recalls past the sliding window's reach (its skips)", "pi_attention", "sliding_window",
     (W + 1, S * P + W + 1), "difference", False),
    ("BCMT's memory recalls past one block, where HOnly cannot", "bcmt", "honly", (L + 1, 10**9),
     "difference", False),
    ("ECP recalls as well as Perceiver-AR where its layers give it a path (4 layers: every query "
     "past its one-hop reach)", "ecp_4layers", "perceiver_ar_4layers", (L + 1, 10**9),
     "equivalence", True),
    ("control: dense recalls past the sliding window's reach", "dense", "sliding_window",
     (W + 1, 10**9), "difference", False),
]
# "<model> gains from the context beyond the cut on <corpus>": the swap ablation's delta over seeds.
ABLATION_MODELS = ("dense", "pi_attention", "bcmt", "ecp", "perceiver_ar")
ABLATION_CORPORA = ("python_code", "shakespeare")


def family_size() -> int:
  from experiments.paper_tables.specs import TABLES  # pylint: disable=import-outside-toplevel
  return (len(RECALL_CLAIMS) + sum(len(t["claims"]) for t in TABLES.values())
          + len(ABLATION_MODELS) * len(ABLATION_CORPORA))


def load_json(path: str) -> dict | None:
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


# ----------------------------------------------------------------------------------------------
# Recall claims.


def in_reach_accuracy(run: dict) -> float | None:
  """The share of the test queries its attention reaches in one hop that a run recalls (None
  when it reaches none)."""
  q = long_range.load_queries(run)
  inside = long_range.in_reach(run["model"], q["position"], q["distance"])
  return float(q["correct"][inside].mean()) if inside.any() else None


def recall_claim(results: dict, claim: str, a: str, b: str, bins: tuple[int, int], kind: str,
                 path_only: bool) -> stats.Claim:
  """The claim over the seeds both models have; per seed the accuracy over the judged queries
  (those at the claim's distances; with `path_only`, those A's attention has a path to), and the
  query bootstrap of that seed's difference as a description (`described`)."""
  runs = results["runs"]
  seeds = sorted({r["seed"] for r in runs.values() if r["model"] == a} &
                 {r["seed"] for r in runs.values() if r["model"] == b})
  why_not = True  # no seeds yet: pending, not "not comparable"
  accuracy = {a: {}, b: {}}
  described = []
  for seed in seeds:
    ra, rb = runs[long_range.row_key(a, seed)], runs[long_range.row_key(b, seed)]
    for model, run in ((a, ra), (b, rb)):
      acc = in_reach_accuracy(run)
      if acc is not None and acc < TRAINED and why_not is True:
        why_not = (f"not trained: {model}@{seed} recalls {acc:.2f} of the queries inside its own "
                   f"reach (< {TRAINED})")
    if ra["steps"] != rb["steps"] and why_not is True:
      why_not = "not trained to the same point (different steps)"
    qa, qb = long_range.load_queries(ra), long_range.load_queries(rb)
    if not (np.array_equal(qa["sequence"], qb["sequence"]) and np.array_equal(qa["distance"], qb["distance"])):
      raise ValueError(f"{a}@{seed} and {b}@{seed} were scored on different queries")
    judged = (qa["distance"] >= bins[0]) & (qa["distance"] < bins[1])
    if path_only:
      judged &= long_range.multi_hop_reach(a, qa["position"], qa["distance"])
    accuracy[a][seed] = float(qa["correct"][judged].mean())
    accuracy[b][seed] = float(qb["correct"][judged].mean())
    boot = stats.paired_bootstrap(qa["correct"][judged].astype(float), qb["correct"][judged].astype(float),
                                  groups=qa["sequence"][judged], higher_is_better=True,
                                  num_resamples=2000, seed=seed)
    described.append({"seed": seed, "judged_queries": int(judged.sum()),
                      "accuracy_a": accuracy[a][seed], "accuracy_b": accuracy[b][seed],
                      "query_bootstrap": {"difference": boot.difference, "ci_low": boot.ci_low,
                                          "ci_high": boot.ci_high}})
  if kind == "equivalence":
    result = stats.equivalence_test(accuracy[a], accuracy[b], higher_is_better=True,
                                    margin=stats.EQUIVALENCE_MARGIN["recall"])
  else:
    result = stats.paired_t_test(accuracy[a], accuracy[b], higher_is_better=True)
  return stats.Claim(claim, kind, result, len(seeds), stats.PLANNED_SEEDS["recall"], why_not), {
      "source": "long_range", "a": a, "b": b, "metric": "recall (accuracy)",
      "distances": list(bins), "path_only": path_only, "per_seed": described}


# ----------------------------------------------------------------------------------------------
# The paper tables' claims.


def table_claims(paper_tables: dict | None, positions: dict | None) -> list[tuple]:
  from experiments.paper_tables.render import grouped, metric_values  # pylint: disable=import-outside-toplevel
  from experiments.paper_tables.specs import TABLES  # pylint: disable=import-outside-toplevel
  out = []
  for table, spec in TABLES.items():
    entry = ((paper_tables or {}).get("tables") or {}).get(table, {})
    groups = {k: [r for r in rs if "scores" in r] for k, rs in grouped(entry.get("rows", {}), table)}
    for text, a, b, metric, paper, *kind in spec["claims"]:
      kind = kind[0] if kind else "difference"
      values = {}
      for model in (a, b):
        rows = groups.get(model) or []
        v = metric_values(rows, metric, (positions or {}).get(table, {})) if rows else None
        values[model] = {r["seed"]: x for r, x in zip(rows, v)} if v is not None else {}
      if kind == "equivalence":
        result = stats.equivalence_test(values[a], values[b], margin=stats.EQUIVALENCE_MARGIN["loss"])
      else:
        result = stats.paired_t_test(values[a], values[b])  # losses: lower is better
      seeds = len(set(values[a]) & set(values[b]))
      out.append((stats.Claim(text, kind, result, seeds, stats.PLANNED_SEEDS["loss"]), {
          "source": f"paper_tables:{table}", "a": a, "b": b, "metric": metric[0], "paper": paper,
          "per_seed": [{"seed": s, "a": values[a][s], "b": values[b][s]}
                       for s in sorted(set(values[a]) & set(values[b]))]}))
  return out


# ----------------------------------------------------------------------------------------------
# The swap ablation's claims.


def ablation_claims(ablation: dict | None) -> list[tuple]:
  """Per model and corpus, "gains from the context beyond the cut": the per-seed paired t of the
  ablated against the full loss (positive difference = ablated - full: the context is used)."""
  rows = [r for r in (ablation or {}).get("rows", []) if r.get("method") == "swap"]
  out = []
  for corpus in ABLATION_CORPORA:
    for model in ABLATION_MODELS:
      mine = sorted((r for r in rows if r["corpus"] == corpus and r["model"] == model),
                    key=lambda r: r["seed"])
      cut = CORPORA[corpus]["ablate"]
      if any(r["ablate_context"] != cut for r in mine):
        raise ValueError(f"{corpus}/{model}: swap rows cut at {sorted({r['ablate_context'] for r in mine})}, "
                         f"the claim at {cut}")
      full = {r["seed"]: r["full_loss"] for r in mine}
      ablated = {r["seed"]: r["ablated_loss"] for r in mine}
      claim = f"{model} gains from the context beyond {cut} tokens on {corpus} (swap ablation)"
      out.append((stats.Claim(claim, "difference", stats.paired_t_test(full, ablated), len(mine),
                              stats.PLANNED_SEEDS["loss"]), {
          "source": "context_ablation", "a": model, "b": f"{model}, context beyond the cut swapped",
          "metric": "validation loss (nats/token)", "corpus": corpus,
          "per_seed": [{"seed": r["seed"], "full_loss": r["full_loss"], "ablated_loss": r["ablated_loss"],
                        "delta": r["delta"], "ci_low": r["ci_low"], "ci_high": r["ci_high"],
                        "documents": r["documents"]} for r in mine]}))
  return out


def exact_nulls(ablation: dict | None) -> list[dict]:
  """The swap rows of models whose reach is below the kept context: exactly 0 by construction."""
  rows = [r for r in (ablation or {}).get("rows", []) if r.get("method") == "swap" and r["exact_null"]]
  return [{"model": r["model"], "corpus": r["corpus"], "seed": r["seed"], "delta": r["delta"],
           "exact_zero": r["delta"] == 0.0} for r in sorted(rows, key=lambda r: (r["corpus"], r["model"],
                                                                                   r["seed"]))]


# ----------------------------------------------------------------------------------------------
# The family.


def decide_all(long_range_results: dict | None = None, paper_tables: dict | None = None,
               positions: dict | None = None, ablation: dict | None = None) -> dict:
  """verdicts.json's content: `rows` (claims with their planned seeds, decided), `pending`
  (claims short of them), the family's size and rule, and the exact nulls."""
  tested = []
  if long_range_results is not None:
    tested += [recall_claim(long_range_results, *c) for c in RECALL_CLAIMS]
  tested += table_claims(paper_tables, positions)
  tested += ablation_claims(ablation)
  size = family_size()
  decided = stats.decide_family([c for c, _ in tested], family_size=size)
  rows, pending = [], []
  for (claim, extra), row in zip(tested, decided):
    row = {**row, **extra}
    (pending if row["note"].startswith("pending") or claim.seeds < claim.planned else rows).append(row)
  return {"rows": rows, "pending": pending, "family_size": size, "partial": bool(pending),
          "planned_seeds": stats.PLANNED_SEEDS, "equivalence_margin": stats.EQUIVALENCE_MARGIN,
          "rule": ("per-seed paired t (difference) or two one-sided t tests (equivalence) over "
                   "training seeds; Benjamini-Hochberg adjusted p < 0.05 over the family decides; "
                   "claims short of their planned seeds are pending and count as p = 1"),
          "exact_nulls": exact_nulls(ablation),
          "ablation_sanity_failures": sanity_check((ablation or {}).get("rows", []))}


def load_all(results_dir: str = RESULTS) -> dict:
  """The results files `decide_all` reads (None where absent)."""
  return {"long_range_results": load_json(os.path.join(results_dir, "long_range.json")),
          "paper_tables": load_json(os.path.join(results_dir, "paper_tables.json")),
          "positions": load_json(os.path.join(results_dir, "paper_tables_per_position.json")),
          "ablation": load_json(os.path.join(results_dir, "context_ablation.json"))}


def by_claim(verdicts: dict) -> dict[str, dict]:
  return {r["claim"]: r for r in verdicts["rows"] + verdicts["pending"]}


# ----------------------------------------------------------------------------------------------
# Markdown.


def _p(p) -> str:
  return "" if p is None or p != p else ("< 0.001" if p < 0.001 else f"{p:.3f}")


def verdict_cell(row: dict) -> str:
  v = row["verdict"]
  if row["note"].startswith("pending"):
    return f"not decided ({row['note']})"
  return f"**{v}**" if v not in (stats.NOT_DECIDED, stats.NOT_COMPARABLE) else (
      f"{v} ({row['note']})" if row["note"] else v)


def render_verdicts(verdicts: dict) -> str:
  """The family's table: every claim, its seeds, test, raw and adjusted p, verdict."""
  lines = [f"Family: {verdicts['family_size']} claims; decided: {len(verdicts['rows'])}; pending "
           f"(fewer seeds than planned): {len(verdicts['pending'])}"
           + (" (**partial**: runs still to come)" if verdicts["partial"] else "") + ".", "",
           "| claim | source | seeds | difference (A better > 0) | 95% interval (TOST: 90%) | test | p | "
           "p adjusted (BH) | verdict |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in verdicts["rows"] + verdicts["pending"]:
    d = row["difference"]
    diff = "" if d is None or d != d else f"{d:+.4f}"
    ci = ("" if row["ci_low"] is None or row["ci_low"] != row["ci_low"]
          else f"[{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]")
    test = row["test"] + (f", margin {row['margin']}" if "margin" in row else "")
    lines.append(f"| {row['claim']} | {row['source']} | {row['seeds']} of {row['planned_seeds']} | {diff} | "
                 f"{ci} | {test} | {_p(row['p_value'])} | {_p(row['p_adjusted'])} | {verdict_cell(row)} |")
  return "\n".join(lines)


def render_ablation(ablation: dict | None) -> str:
  """The swap ablation: per corpus and model, each seed's full loss, ablated loss and delta."""
  rows = [r for r in (ablation or {}).get("rows", []) if r.get("method") == "swap"]
  if not rows:
    return "(no swap rows yet: `python -m experiments.context_ablation`)"
  lines = ["| corpus | model | cut (kept context) | seed | full loss | ablated loss (swap) | delta | "
           "95% interval over documents (this run) | documents |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  order = {m: i for i, m in enumerate(("dense", "pi_attention", "sliding_window", "bcmt", "honly", "ecp",
                                       "perceiver_ar"))}
  for r in sorted(rows, key=lambda r: (r["corpus"], order.get(r["model"], 99), r["seed"])):
    delta = "0 (exact)" if r["exact_null"] and r["delta"] == 0.0 else f"{r['delta']:+.4f}"
    lines.append(f"| `{r['corpus']}` | `{r['model']}` | {r['ablate_context']} ({r['kept_context'][0]}-"
                 f"{r['kept_context'][1]}) | {r['seed']} | {r['full_loss']:.4f} | {r['ablated_loss']:.4f} | "
                 f"{delta} | [{r['ci_low']:+.4f}, {r['ci_high']:+.4f}] | {r['documents']} |")
  pairs = sorted({(r["corpus"], r["seed"]) for r in rows if r["model"] == "bcmt"} &
                 {(r["corpus"], r["seed"]) for r in rows if r["model"] == "honly"})
  failures = sanity_check(rows)
  lines += ["", f"Sanity check (ablated BCMT against HOnly's full loss) over {len(pairs)} corpus-seed "
            f"pairs: " + ("passes." if not failures else f"**fails** in {len(failures)}:")]
  lines += [f"- {f}" for f in failures]
  return "\n".join(lines)


def replace_block(text: str, marker: str, body: str) -> str:
  """The text between `<!-- marker -->` and `<!-- /marker -->` replaced by `body` (unchanged when
  the markers are absent)."""
  begin, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
  if begin not in text or end not in text:
    return text
  head, rest = text.split(begin, 1)
  _, tail = rest.split(end, 1)
  return f"{head}{begin}\n{body}\n{end}{tail}"


def render_readme(verdicts: dict, loaded: dict, readme: str = README) -> None:
  if not os.path.isfile(readme):
    return
  with open(readme) as f:
    text = f.read()
  text = replace_block(text, "verdicts", render_verdicts(verdicts))
  text = replace_block(text, "context_ablation", render_ablation(loaded["ablation"]))
  if loaded["long_range_results"] is not None:
    text = replace_block(text, "long_range", long_range.render(loaded["long_range_results"]))
  with open(readme, "w") as f:
    f.write(text)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--results_dir", default=RESULTS)
  parser.add_argument("--readme", default=README)
  args = parser.parse_args(argv)
  loaded = load_all(args.results_dir)
  verdicts = decide_all(**loaded)
  with open(os.path.join(args.results_dir, "verdicts.json"), "w") as f:
    json.dump(verdicts, f, indent=1)
  render_readme(verdicts, loaded, args.readme)
  from experiments.paper_tables.render import render_readme as render_tables  # pylint: disable=import-outside-toplevel
  if loaded["paper_tables"] is not None:
    render_tables(loaded["paper_tables"], loaded["positions"] or {}, args.readme, verdicts=verdicts)
  for row in verdicts["rows"] + verdicts["pending"]:
    print(f"{row['verdict']:>15}  p_adj={_p(row['p_adjusted']):>7}  {row['seeds']}/{row['planned_seeds']} "
          f"seeds  {row['claim']}")


if __name__ == "__main__":
  main()
