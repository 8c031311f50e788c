"""Every claim, decided over training seeds by the rules of `efficient_lm.evaluation.stats`, where its runs
came after its registration (`experiments/registration.py`).

    python -m experiments.verdicts     # results/verdicts.json and the READMEs' tables, from the results

The family (`family_size()` claims, listed here and in `paper_tables.specs.TABLES`, fixed at commit
fac81a2 after some of their runs: `experiments/registered/seed_level_family.json`):

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
description (`per_seed`), never a verdict. A claim resting on a run from before its registration is
exploratory, a swap claim with a row the placebo gate does not validate is not validated: neither
gets a verdict. The confirmatory studies of `experiments/registered/` are decided apart
(`registered_claims`), each a family of one, from their own results under results/registered/.

Preconditions ("not comparable" whatever the numbers): recall claims need every run of both models
to recall at least `TRAINED` of the queries its own attention reaches in one hop (a model that
fails where it can reach is not trained, not refuted) and the same steps.
"""

import argparse
import json
import os

import numpy as np

from efficient_lm.evaluation import stats
from experiments import key_lookup_pilot
from experiments import long_range
from experiments import needle_study
from experiments import needle_variants
from experiments import registration
from experiments.claims import DIFFER, EXPLORATORY, MEASURED, NOT_VALIDATED, by_claim, verdict_cell  # noqa: F401 (by_claim)
from experiments.common import REPO
from experiments.context_ablation import CORPORA
from experiments.context_ablation import placebo
from experiments.paper_tables.metrics import grouped, metric_values
from experiments.paper_tables.render import render_readme as render_tables

LEGACY = "seed_level_family"  # experiments/registered/: the 32 claims below
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
  codes = {s: [runs[long_range.row_key(m, s)].get("code") for m in (a, b)] for s in seeds}
  return stats.Claim(claim, kind, result, len(seeds), stats.PLANNED_SEEDS["recall"], why_not), {
      "codes": codes, "source": "long_range", "a": a, "b": b, "metric": "recall (accuracy)",
      "distances": list(bins), "path_only": path_only, "per_seed": described}


# ----------------------------------------------------------------------------------------------
# The paper tables' claims.


def table_claims(paper_tables: dict | None, positions: dict | None) -> list[tuple]:
  from experiments.paper_tables.specs import TABLES  # pylint: disable=import-outside-toplevel
  out = []
  for table, spec in TABLES.items():
    entry = ((paper_tables or {}).get("tables") or {}).get(table, {})
    groups = {k: [r for r in rs if "scores" in r] for k, rs in grouped(entry.get("rows", {}), table)}
    for text, a, b, metric, paper, *kind in spec["claims"]:
      kind = kind[0] if kind else "difference"
      values, codes = {}, {}
      for model in (a, b):
        rows = groups.get(model) or []
        v = metric_values(rows, metric, (positions or {}).get(table, {})) if rows else None
        values[model] = {r["seed"]: x for r, x in zip(rows, v)} if v is not None else {}
        for r in rows:
          codes.setdefault(r["seed"], []).append(r.get("code"))
      if kind == "equivalence":
        result = stats.equivalence_test(values[a], values[b], margin=stats.EQUIVALENCE_MARGIN["loss"])
      else:
        result = stats.paired_t_test(values[a], values[b])  # losses: lower is better
      seeds = len(set(values[a]) & set(values[b]))
      paired = set(values[a]) & set(values[b])
      out.append((stats.Claim(text, kind, result, seeds, stats.PLANNED_SEEDS["loss"]), {
          "codes": {s: c for s, c in codes.items() if s in paired}, "source": f"paper_tables:{table}", "a": a, "b": b, "metric": metric[0], "paper": paper,
          "per_seed": [{"seed": s, "a": values[a][s], "b": values[b][s]}
                       for s in sorted(set(values[a]) & set(values[b]))]}))
  return out


# ----------------------------------------------------------------------------------------------
# The swap ablation's claims.


def placebo_gate() -> dict:
  return registration.studies()["swap_placebo_gate"]


def ablation_claims(ablation: dict | None) -> list[tuple]:
  """Per model and corpus, "gains from the context beyond the cut": the per-seed paired t of the
  ablated against the full loss (positive difference = ablated - full: the context is used), each
  row with its placebo bin and the gate's mark (`context_ablation.placebo`)."""
  rows = [r for r in (ablation or {}).get("rows", []) if r.get("method") == "swap"]
  gate = placebo_gate()
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
      marks = {r["seed"]: placebo(r, gate) for r in mine}
      out.append((stats.Claim(claim, "difference", stats.paired_t_test(full, ablated), len(mine),
                              stats.PLANNED_SEEDS["loss"]), {
          "codes": {r["seed"]: [r.get("code")] for r in mine},
          "placebo_validated": bool(marks) and all(m["validated"] for m in marks.values()),
          "source": "context_ablation", "a": model, "b": f"{model}, context beyond the cut swapped",
          "metric": "validation loss (nats/token)", "corpus": corpus,
          "per_seed": [{"seed": r["seed"], "full_loss": r["full_loss"], "ablated_loss": r["ablated_loss"],
                        "delta": r["delta"], "ci_low": r["ci_low"], "ci_high": r["ci_high"],
                        "documents": r["documents"], "placebo": marks[r["seed"]]} for r in mine]}))
  return out


def exact_nulls(ablation: dict | None) -> list[dict]:
  """The swap rows of models whose reach is below the kept context: exactly 0 by construction."""
  rows = [r for r in (ablation or {}).get("rows", []) if r.get("method") == "swap" and r["exact_null"]]
  return [{"model": r["model"], "corpus": r["corpus"], "seed": r["seed"], "delta": r["delta"],
           "exact_zero": r["delta"] == 0.0} for r in sorted(rows, key=lambda r: (r["corpus"], r["model"],
                                                                                   r["seed"]))]


# ----------------------------------------------------------------------------------------------
# The family.


def _relabel(row: dict, extra: dict, study: dict) -> dict:
  """The row with its registration label; an exploratory claim, or a swap claim the placebo gate
  does not validate, gets no verdict (its figures stay)."""
  codes = extra.pop("codes")
  row = {**row, **extra, "registration": registration.label(study, codes)}
  if row["note"].startswith("pending"):
    return row
  if row["registration"]["status"] == registration.EXPLORATORY:
    before = row["registration"]["seeds_before_registration"]
    row.update(verdict=EXPLORATORY, note=f"seeds {', '.join(map(str, before))} ran before the claim "
               f"was registered ({row['registration']['registered_in']})")
  elif extra.get("placebo_validated") is False:
    row.update(verdict=NOT_VALIDATED, note="the placebo gate does not validate every row")
  return row


def _long_range_values(spec: dict, found: dict) -> tuple[dict, dict, list, bool | str]:
  """A registered MQAR claim's per-seed recall (experiments/long_range.py's results format): per
  run, the accuracy over the test queries at the claim's `distances` [low, high). Not comparable
  when a run recalls less than `TRAINED` of the queries its own attention reaches in one hop, or
  the arms trained different steps."""
  a, b = spec["a"], spec["b"]
  low, high = spec["distances"]
  values, codes, comparable = {a: {}, b: {}}, {}, True
  runs = [r for r in (found.get("runs") or {}).values() if r["model"] in (a, b)]
  steps = {}
  for run in sorted(runs, key=lambda r: (r["seed"], r["model"])):
    q = long_range.load_queries(run)
    judged = (q["distance"] >= low) & (q["distance"] < high)
    values[run["model"]][run["seed"]] = float(q["correct"][judged].mean())
    codes.setdefault(run["seed"], []).append(run.get("code"))
    steps.setdefault(run["seed"], set()).add(run["steps"])
    acc = in_reach_accuracy(run)
    if acc is not None and acc < TRAINED and comparable is True:
      comparable = (f"not trained: {run['model']}@{run['seed']} recalls {acc:.2f} of the queries "
                    f"inside its own reach (< {TRAINED})")
  if comparable is True and any(len(s) > 1 for s in steps.values()):
    comparable = "not trained to the same point (different steps)"
  return values, codes, runs, comparable


def _study_values(name: str, spec: dict, results: dict, study: dict | None = None
                  ) -> tuple[dict, dict, list, bool | str]:
  """({model: {seed: value}} with None for B of a swap delta, {seed: [code, ...]}, the rows read,
  True or why the arms are not comparable) of one claim of a registered study, from its results
  file; how it is read follows the study's `source` (its results' format)."""
  found = results.get(name) or {}
  source = (study or {}).get("source") or {"bcmt_replication": "paper_tables:bcmt",
                                           "needle_reach": "needle_study"}.get(name, "context_ablation")
  values, codes = {spec["a"]: {}, spec.get("b"): {}}, {}
  if source == "long_range":
    return _long_range_values(spec, found)
  if source.startswith("paper_tables:"):
    table = source.split(":", 1)[1]
    rows = [r for r in ((found.get("tables") or {}).get(table, {}).get("rows", {})).values()
            if "scores" in r]
    metric = tuple(tuple(tuple(x) for x in m) if isinstance(m, list) else m for m in spec["metric"])
    per_position = (results.get(name + "_per_position") or {}).get(table, {})
    for model in (spec["a"], spec["b"]):
      mine = sorted((r for r in rows if r["config_key"] == model), key=lambda r: r["seed"])
      v = metric_values(mine, metric, per_position) if mine else None
      for r, x in zip(mine, v if v is not None else []):
        values[model][r["seed"]] = x
        codes.setdefault(r["seed"], []).append(r.get("code"))
  elif source == "needle_study":  # experiments/needle_study.py rows: one per model and seed
    rows = found.get("rows", [])
    for r in rows:
      if r["model"] in (spec["a"], spec.get("b")) and r.get(spec["metric"]) is not None:
        values[r["model"]][r["seed"]] = r[spec["metric"]]
        codes.setdefault(r["seed"], []).append(r.get("code"))
  else:  # context_ablation rows (pi_window_code)
    rows = [r for r in found.get("rows", []) if r.get("method") == "swap"]
    for r in rows:
      if spec.get("b") is None and r["model"] == spec["a"]:  # the swap delta: full vs ablated
        values[spec["a"]][r["seed"]] = r["full_loss"]
        values[None][r["seed"]] = r["ablated_loss"]
      elif r["model"] in (spec["a"], spec.get("b")):
        values[r["model"]][r["seed"]] = r["full_loss"]
      else:
        continue
      codes.setdefault(r["seed"], []).append(r.get("code"))
  return values, codes, rows, True


def registered_claims(results: dict[str, dict | None]) -> list[dict]:
  """The confirmatory studies' claims (experiments/registered/, `kind` confirmatory), decided
  only from runs after their registration (pending until their seeds ran); a study's primary
  claims are one family (Benjamini-Hochberg over them), its secondary measures reported."""
  out = []
  for name, study in registration.studies().items():
    if study["kind"] != "confirmatory":
      continue
    commit = registration.study_commit(study)
    specs = study["claims"] + study.get("secondary", [])
    tested = []
    for spec in specs:
      values, codes, rows, comparable = _study_values(name, spec, results, study)
      excluded = []
      for seed in sorted(codes):  # only runs after the registration, only the registered seeds
        if seed not in study["seeds"] or not all(registration.ran_after(commit, c) for c in codes[seed]):
          excluded.append(seed)
          for v in values.values():
            v.pop(seed, None)
      # Lower is better unless the claim says otherwise (accuracies); for the swap delta A is the
      # full loss and B the ablated one, so a positive difference is a gain from the far context,
      # as in `ablation_claims`.
      a, b = values[spec["a"]], values[spec.get("b")]
      higher = bool(spec.get("higher_is_better"))
      if spec["kind"] == "equivalence":  # TOST against the margin the registration states
        result = stats.equivalence_test(a, b, margin=spec["margin"], higher_is_better=higher)
      else:
        result = stats.paired_t_test(a, b, higher_is_better=higher)
      claim = stats.Claim(spec["text"], spec["kind"], result, len(set(a) & set(b)), len(study["seeds"]),
                          comparable)
      tested.append((spec, claim, rows, excluded, a, b))
    primaries = [t for t in tested if t[0] in study["claims"]]
    decided = dict(zip((id(t[0]) for t in primaries),
                       stats.decide_family([t[1] for t in primaries])))
    for spec, claim, rows, excluded, a, b in tested:
      primary = spec in study["claims"]
      row = decided[id(spec)] if primary else stats.decide_family([claim])[0]
      per_seed = [{"seed": s, "a": a[s], "b": b[s]} for s in sorted(set(a) & set(b))]
      if spec.get("b") is None:  # swap rows: each with its placebo bin and the gate's mark
        gated = {r["seed"]: placebo(r, placebo_gate()) for r in rows if r["model"] == spec["a"]}
        for entry in per_seed:
          entry["placebo"] = gated[entry["seed"]]
      if not primary and not row["note"].startswith("pending"):
        unvalidated = any(not e.get("placebo", {"validated": True})["validated"] for e in per_seed)
        row.update(verdict="reported (secondary)", note="a secondary measure: never a verdict"
                   + ("; the placebo gate does not validate every row" if unvalidated else ""))
      # A two-sided difference decided either way reads "differ", with the arm it puts ahead
      # (stats' labels read from A's side: confirmed for A ahead, refuted for B ahead, which
      # reads as the opposite of "they differ" when B is ahead).
      ahead = {stats.CONFIRMED: spec["a"], stats.REFUTED: spec.get("b")}.get(row["verdict"])
      if ahead is not None and spec["kind"] == "difference" and spec.get("sides", 2) == 2:
        row["verdict"] = DIFFER
      out.append({**row, "study": name, "id": spec["id"], "primary": primary,
                  "ahead": ahead, "measured": MEASURED.get(spec["id"]),
                  "registered_in": commit[:7] if commit else None,
                  "seeds_excluded": excluded, "per_seed": per_seed})
  return out


def registered_controls(results: dict[str, dict | None]) -> list[dict]:
  """The registered studies' controls: a threshold each of the model's per-seed values must meet
  (`at_least` or `at_most`, `chance` added where the control says so), decided at the study's
  full seeds from runs after its registration: holds (every seed meets it), fails, or pending.
  A seed that misses the bound fails the control at once: every seed must meet it, so the seeds
  still to run cannot change that verdict."""
  out = []
  for name, study in registration.studies().items():
    commit = registration.study_commit(study)
    for control in study.get("controls", []):
      values, codes, _, _ = _study_values(name, {"a": control["model"], "metric": control["metric"]},
                                          results, study)
      rows = {r["seed"]: r for r in (results.get(name) or {}).get("rows", [])
              if r["model"] == control["model"]}
      seeds = [s for s in sorted(values[control["model"]]) if s in study["seeds"]
               and all(registration.ran_after(commit, c) for c in codes[s])]
      per_seed = []
      for s in seeds:
        bound = control["bound"] + (rows[s].get(control["plus"], 0.0) if control.get("plus") else 0.0)
        value = values[control["model"]][s]
        ok = value >= bound if control["direction"] == "at_least" else value <= bound
        per_seed.append({"seed": s, "value": value, "bound": bound, "meets": ok})
      missed = [e["seed"] for e in per_seed if not e["meets"]]
      power = None
      if control["metric"].startswith("min_cell_") and rows and all("cells" in r for r in rows.values()):
        # the lowest of many small cells: how often a model that truly meets it would
        cells, per_cell = len(next(iter(rows.values()))["cells"]), needle_study.GRID["needles_per_cell"]
        truth = round(control["bound"] + 0.05, 4)
        power = {"true_share": truth, "cells": cells, "per_cell": per_cell, "seeds": len(study["seeds"]),
                 "holds": stats.every_cell_power(per_cell, cells, truth, control["bound"])
                 ** len(study["seeds"])}
      if missed:
        verdict = "fails" if len(per_seed) == len(study["seeds"]) else (
            f"fails (seed{'s' if len(missed) > 1 else ''} {', '.join(map(str, missed))} of "
            f"{len(per_seed)} run so far; the rest cannot change it)")
      elif len(per_seed) < len(study["seeds"]):
        verdict = f"pending ({len(per_seed)} of {len(study['seeds'])} seeds)"
      else:
        verdict = "holds"
      out.append({"study": name, "id": control["id"], "claim": control["text"],
                  "verdict": verdict, "per_seed": per_seed, "power": power,
                  "registered_in": commit[:7] if commit else None})
  return out


def decide_all(long_range_results: dict | None = None, paper_tables: dict | None = None,
               positions: dict | None = None, ablation: dict | None = None,
               registered: dict | None = None) -> dict:
  """verdicts.json's content: `rows` (claims with their planned seeds, decided), `pending`
  (claims short of them), the family's size and rule, the exact nulls, and the registered
  studies' claims (`registered`: their results files by study name)."""
  tested = []
  if long_range_results is not None:
    tested += [recall_claim(long_range_results, *c) for c in RECALL_CLAIMS]
  tested += table_claims(paper_tables, positions)
  tested += ablation_claims(ablation)
  size = family_size()
  decided = stats.decide_family([c for c, _ in tested], family_size=size)
  legacy = registration.studies()[LEGACY]
  rows, pending = [], []
  for (claim, extra), row in zip(tested, decided):
    row = _relabel(row, extra, legacy)
    (pending if row["note"].startswith("pending") or claim.seeds < claim.planned else rows).append(row)
  return {"rows": rows, "pending": pending, "family_size": size, "partial": bool(pending),
          "planned_seeds": stats.PLANNED_SEEDS, "equivalence_margin": stats.EQUIVALENCE_MARGIN,
          "rule": ("per-seed paired t (difference) or two one-sided t tests (equivalence) over "
                   "training seeds; Benjamini-Hochberg adjusted p < 0.05 over the family decides "
                   "(Benjamini-Yekutieli beside it); claims short of their planned seeds are pending "
                   "and count as p = 1; a claim resting on a run from before its registration "
                   "(experiments/registered/) is exploratory, and a swap claim whose rows the "
                   "placebo gate does not validate is not validated: neither gets a verdict"),
          "exact_nulls": exact_nulls(ablation),
          "registered": registered_claims(registered or {}),
          "registered_controls": registered_controls(registered or {})}


def load_all(results_dir: str = RESULTS) -> dict:
  """The results files `decide_all` reads (None where absent)."""
  registered = {}
  for name in registration.studies():
    registered[name] = load_json(os.path.join(results_dir, "registered", f"{name}.json"))
    registered[name + "_per_position"] = load_json(
        os.path.join(results_dir, "registered", f"{name}_per_position.json"))
  return {"long_range_results": load_json(os.path.join(results_dir, "long_range.json")),
          "paper_tables": load_json(os.path.join(results_dir, "paper_tables.json")),
          "positions": load_json(os.path.join(results_dir, "paper_tables_per_position.json")),
          "ablation": load_json(os.path.join(results_dir, "context_ablation.json")),
          "registered": registered}


# ----------------------------------------------------------------------------------------------
# Markdown.


def _p(p) -> str:
  return "" if p is None or p != p else ("< 0.001" if p < 0.001 else f"{p:.3f}")


def _diff_ci(row: dict) -> tuple[str, str]:
  d = row["difference"]
  diff = "" if d is None or d != d else f"{d:+.4f}"
  ci = ("" if row["ci_low"] is None or row["ci_low"] != row["ci_low"]
        else f"[{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]")
  return diff, ci


def render_verdicts(verdicts: dict) -> str:
  """The family's table: every claim, its seeds, test, raw and adjusted p (BH and BY), whether its
  runs came after its registration, verdict."""
  counts = {}
  for row in verdicts["rows"]:
    counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
  lines = [f"Family: {verdicts['family_size']} claims; with their planned seeds: {len(verdicts['rows'])} ("
           + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) + f"); pending: "
           f"{len(verdicts['pending'])}" + (" (**partial**: runs still to come)" if verdicts["partial"] else "")
           + ".", "",
           "| claim | source | seeds | difference (A better > 0) | 95% interval (TOST: 90%) | test | p | "
           "p adjusted (BH) | p adjusted (BY) | registration | verdict |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in verdicts["rows"] + verdicts["pending"]:
    diff, ci = _diff_ci(row)
    test = row["test"] + (f", margin {row['margin']}" if "margin" in row else "")
    reg = row.get("registration") or {}
    lines.append(f"| {row['claim']} | {row['source']} | {row['seeds']} of {row['planned_seeds']} | {diff} | "
                 f"{ci} | {test} | {_p(row['p_value'])} | {_p(row['p_adjusted'])} | "
                 f"{_p(row.get('p_adjusted_by'))} | {reg.get('status', '')} | {verdict_cell(row)} |")
  return "\n".join(lines)


def render_registered(verdicts: dict) -> str:
  """The confirmatory studies (experiments/registered/): each claim (its registered text, quoted:
  never edited after its registration; where it says more than its test measured, `MEASURED`
  beside it), its seeds so far, raw and
  adjusted p (Benjamini-Hochberg, which decides, and Benjamini-Yekutieli beside it; over the
  study's primary claims, a secondary measure alone), verdict."""
  rows = verdicts.get("registered") or []
  if not rows:
    return "(no confirmatory study registered)"
  lines = ["| study | claim | registered in | seeds | difference (A better > 0) | 95% interval (TOST: 90%) | p | "
           "p adjusted (BH) | p adjusted (BY) | verdict |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in rows:
    diff, ci = _diff_ci(row)
    kind = "" if row["primary"] else " (secondary)"
    if row.get("measured"):
      kind += f"; what it measured: {row['measured']}"
    lines.append(f"| `{row['study']}` | \"{row['claim']}\"{kind} | `{row['registered_in']}` | {row['seeds']} of "
                 f"{row['planned_seeds']} | {diff} | {ci} | {_p(row['p_value'])} | "
                 f"{_p(row.get('p_adjusted'))} | {_p(row.get('p_adjusted_by'))} | {verdict_cell(row)} |")
  controls = verdicts.get("registered_controls") or []
  if controls:
    lines += ["", "Controls (a threshold every seed must meet; so a seed that misses it fails the "
                  "control before the rest have run):", "",
              "| study | control | registered in | per seed: value (bound) | verdict | chance it holds "
              "for a model that truly meets it |",
              "| --- | --- | --- | --- | --- | --- |"]
    for c in controls:
      seeds = ", ".join(f"{e['seed']}: {e['value']:.3f} ({e['bound']:.3f})" for e in c["per_seed"])
      power = c.get("power")
      chance = "-" if not power else (f"{power['holds']:.3f} (a share of {power['true_share']:.2f} in "
                                      f"each of {power['cells']} cells of {power['per_cell']}, "
                                      f"{power['seeds']} seeds)")
      lines.append(f"| `{c['study']}` | {c['claim']} | `{c['registered_in']}` | {seeds or '-'} | "
                   f"{c['verdict']} | {chance} |")
  return "\n".join(lines)


def render_ablation(ablation: dict | None) -> str:
  """The swap ablation: per corpus and model, each seed's full loss, ablated loss and delta, and
  its placebo bin with the gate's mark."""
  rows = [r for r in (ablation or {}).get("rows", []) if r.get("method") == "swap"]
  if not rows:
    return "(no swap rows yet: `python -m experiments.context_ablation`)"
  gate = placebo_gate()
  lines = ["| corpus | model | cut (kept context) | seed | full loss | ablated loss (swap) | delta | "
           "95% interval over documents (this run) | placebo: delta, upper (tokens, documents) | "
           "later tokens' delta | placebo gate |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  order = {m: i for i, m in enumerate(("dense", "pi_attention", "sliding_window", "bcmt", "honly", "ecp",
                                       "perceiver_ar"))}
  for r in sorted(rows, key=lambda r: (r["corpus"], order.get(r["model"], 99), r["seed"])):
    delta = "0 (exact)" if r["exact_null"] and r["delta"] == 0.0 else f"{r['delta']:+.4f}"
    if r["exact_null"]:
      bin_cell, later, mark = "", "", "exact null"
    else:
      m = placebo(r, gate)
      bin_cell = f"{m['delta']:+.4f}, {m['upper']:+.4f} ({m['tokens']:,}, {m['documents']})"
      later, mark = f"{m['later_delta']:+.4f}", "validated" if m["validated"] else "not validated"
    lines.append(f"| `{r['corpus']}` | `{r['model']}` | {r['ablate_context']} ({r['kept_context'][0]}-"
                 f"{r['kept_context'][1]}) | {r['seed']} | {r['full_loss']:.4f} | {r['ablated_loss']:.4f} | "
                 f"{delta} | [{r['ci_low']:+.4f}, {r['ci_high']:+.4f}] | {bin_cell} | {later} | {mark} |")
  return "\n".join(lines)


def render_summary(verdicts: dict) -> str:
  """experiments/README.md's summary of the verdicts (its `verdicts_summary` block): what is
  decided, and what is not, by label."""
  by = {}
  for row in verdicts["rows"] + verdicts["pending"]:
    by.setdefault(row["verdict"], []).append(row["claim"])
  decided = [v for v in (stats.CONFIRMED, stats.REFUTED, stats.EQUIVALENT, stats.NOT_EQUIVALENT) if v in by]
  lines = [f"Of its {verdicts['family_size']} seed-level claims, "
           f"{sum(len(by[v]) for v in decided)} reach a verdict, "
           f"{len(by.get(EXPLORATORY, []))} are exploratory (some of their runs came before the claim "
           f"was fixed: reported, never a verdict), {len(by.get(NOT_VALIDATED, []))} are not validated "
           f"(the swap ablation's placebo gate) and {len(by.get(stats.NOT_DECIDED, []))} are not decided:"]
  for v in decided:
    lines += [f"- **{v}**: " + "; ".join(by[v]) + "."]
  registered = verdicts.get("registered") or []
  if registered:
    lines += [f"- registered before their runs, {len(registered)} claims of "
              f"{len({r['study'] for r in registered})} confirmatory studies: "
              + "; ".join(f"\"{r['claim']}\" ({r['seeds']} of {r['planned_seeds']} seeds: {r['verdict']}"
                          + (f", {r['ahead']} ahead" if r.get("ahead") else "") + ")"
                          for r in registered if r["primary"]) + "."]
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
  text = replace_block(text, "verdicts_summary", render_summary(verdicts))
  text = replace_block(text, "verdicts", render_verdicts(verdicts))
  text = replace_block(text, "context_ablation", render_ablation(loaded["ablation"]))
  text = replace_block(text, "registered", render_registered(verdicts))
  if loaded["long_range_results"] is not None:
    text = replace_block(text, "long_range", long_range.render(loaded["long_range_results"]))
  text = replace_block(text, "needle_reach",
                       needle_study.render(loaded["registered"].get("needle_reach") or {}))
  text = replace_block(text, "needle_beside",
                       needle_study.render(load_json(needle_study.BESIDE_RESULTS) or {}))
  text = replace_block(text, "needle_variants",
                       needle_variants.render(load_json(needle_variants.RESULTS) or {},
                                              loaded["registered"].get("needle_reach") or {}))
  text = replace_block(text, "key_lookup_pilot",
                       key_lookup_pilot.render(load_json(key_lookup_pilot.RESULTS) or {}))
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
  if loaded["paper_tables"] is not None:
    render_tables(loaded["paper_tables"], loaded["positions"] or {}, args.readme, verdicts=verdicts)
  for row in verdicts["rows"] + verdicts["pending"] + verdicts["registered"]:
    print(f"{row['verdict']:>15}  p_adj={_p(row['p_adjusted']):>7}  {row['seeds']}/{row['planned_seeds']} "
          f"seeds  {row['claim']}")


if __name__ == "__main__":
  main()
