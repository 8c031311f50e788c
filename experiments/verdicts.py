"""The long-range claims, decided by the rule written before the runs (`efficient_lm.stats`).

    python -m experiments.verdicts     # experiments/results/verdicts.json and the README table

Recall claims (experiments/results/long_range.json, every answer of the test split in each row's
`test_queries.npz`): "A recalls better than B" over the distance bins the claim names, judged
per query (the same queries for both models and both seeds) with `stats.paired_bootstrap`,
clustered by (seed, test sequence), and per seed (the mean accuracy over those bins, a paired t
over the seeds both have). The verdict is the bootstrap's (these runs); the per-seed t is
reported beside it, and with 2 seeds decides only very consistent gaps (1 degree of freedom).

Preconditions ("not comparable" whatever the numbers):
  - trained: each model recalls at least `TRAINED` of the queries its own attention reaches in
    one hop (`long_range.in_reach`, from its patterns); a model that does not solve recall where
    it can reach is "not trained", not refuted;
  - the same point: both models trained the same steps on the same task.

Context-ablation claims (experiments/results/context_ablation.json): "the model gains from context
beyond N" is confirmed when the bootstrap interval over documents lies above 0 (p < 0.05).
"""

import json
import os

import numpy as np

from efficient_lm import stats
from experiments import long_range
from experiments.common import REPO

TRAINED = 0.5  # the share of queries inside its own reach a model must recall to be compared
RESULTS = os.path.join(REPO, "experiments", "results")

# (claim, A, B, the distances it is judged on: [low, high)), stated before the runs.
# A query at distance d reads the pair's token d - 1 positions back: the window (W - 1 back) ends
# at d = W, the skips (m P back) reach d = S P + 1, ECP's pieces at most d = L.
W, P, S, L = long_range.W, long_range.P, long_range.S, long_range.L
RECALL_CLAIMS = [
    ("pi-Attention recalls past the sliding window's reach (its skips)", "pi_attention",
     "sliding_window", (W + 1, S * P + W + 1)),
    ("BCMT's memory recalls past one block, where HOnly cannot", "bcmt", "honly", (L + 1, 10**9)),
    ("ECP recalls as far as Perceiver-AR (past ECP's one-hop reach)", "ecp", "perceiver_ar",
     (L + 1, 10**9)),
    ("dense attention recalls past the sliding window's reach", "dense", "sliding_window",
     (W + 1, 10**9)),
]


def load_queries(run: dict) -> dict:
  with np.load(os.path.join(REPO, run["queries_file"])) as f:
    return {k: f[k] for k in f.files}


def in_reach_accuracy(run: dict) -> float | None:
  """The share of the test queries its attention reaches in one hop that a run recalls (None
  when it reaches none)."""
  q = load_queries(run)
  inside = long_range.in_reach(run["model"], q["position"], q["distance"])
  return float(q["correct"][inside].mean()) if inside.any() else None


def recall_claim(results: dict, claim: str, a: str, b: str, bins: tuple[int, int]) -> dict:
  runs = results["runs"]
  seeds = sorted({r["seed"] for r in runs.values() if r["model"] == a} &
                 {r["seed"] for r in runs.values() if r["model"] == b})
  why_not = None
  if not seeds:
    why_not = "not run"
  for model in (a, b):
    for seed in seeds:
      run = runs[long_range.row_key(model, seed)]
      acc = in_reach_accuracy(run)
      if acc is not None and acc < TRAINED:
        why_not = (f"not trained: {model}@{seed} recalls {acc:.2f} of the queries inside its own "
                   f"reach (< {TRAINED})")
  if seeds and len({runs[long_range.row_key(m, s)]["steps"] for m in (a, b) for s in seeds}) > 1:
    why_not = "not trained to the same point (different steps)"
  values = {"a": [], "b": [], "groups": []}
  per_seed = {"a": {}, "b": {}}
  for seed in seeds:
    qa = load_queries(runs[long_range.row_key(a, seed)])
    qb = load_queries(runs[long_range.row_key(b, seed)])
    assert np.array_equal(qa["sequence"], qb["sequence"]) and np.array_equal(
        qa["distance"], qb["distance"]), "the two runs were scored on different queries"
    judged = (qa["distance"] >= bins[0]) & (qa["distance"] < bins[1])
    values["a"].append(qa["correct"][judged].astype(float))
    values["b"].append(qb["correct"][judged].astype(float))
    values["groups"].append(seed * 10**7 + qa["sequence"][judged])
    per_seed["a"][seed] = float(qa["correct"][judged].mean())
    per_seed["b"][seed] = float(qb["correct"][judged].mean())
  out = {"claim": claim, "a": a, "b": b, "distances": list(bins), "seeds": seeds,
         "accuracy_a": per_seed["a"], "accuracy_b": per_seed["b"]}
  if not seeds:
    return {**out, "test": "none", "verdict": stats.NOT_COMPARABLE, "note": why_not}
  test = stats.paired_bootstrap(np.concatenate(values["a"]), np.concatenate(values["b"]),
                                groups=np.concatenate(values["groups"]), higher_is_better=True,
                                seed=0)
  decision = stats.decide(claim, test, comparable=True if why_not is None else why_not)
  t = stats.paired_t_test(per_seed["a"], per_seed["b"], higher_is_better=True)
  return {**out, **decision.as_dict(), "per_seed_t": {"difference": t.difference,
                                                      "p_value": t.p_value, "ci_low": t.ci_low,
                                                      "ci_high": t.ci_high, "n": t.n}}


def ablation_claims(path: str) -> list[dict]:
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    rows = json.load(f)["rows"]
  out = []
  for r in rows:
    claim = f"{r['model']} gains from context beyond {r['ablate_context']} tokens on {r['corpus']}"
    if r.get("exact_null"):
      verdict = stats.REFUTED if r["delta"] == 0.0 else stats.NOT_DECIDED
      out.append({"claim": claim, "test": "exact (the model's reach is below the cut)",
                  "statistic": r["delta"], "p_value": None, "ci_low": r["ci_low"],
                  "ci_high": r["ci_high"], "verdict": verdict, "seed": r["seed"]})
      continue
    confirmed = r["ci_low"] > 0 and r["p_value"] < stats.ALPHA
    refuted = r["ci_high"] < 0 and r["p_value"] < stats.ALPHA
    out.append({"claim": claim, "test": "paired bootstrap over documents",
                "statistic": r["delta"], "p_value": r["p_value"], "ci_low": r["ci_low"],
                "ci_high": r["ci_high"], "seed": r["seed"],
                "verdict": stats.CONFIRMED if confirmed else stats.REFUTED if refuted
                else stats.NOT_DECIDED})
  return out


def main() -> None:
  verdicts = []
  recall_path = os.path.join(RESULTS, "long_range.json")
  if os.path.isfile(recall_path):
    with open(recall_path) as f:
      results = json.load(f)
    verdicts += [recall_claim(results, *claim) for claim in RECALL_CLAIMS]
  verdicts += ablation_claims(os.path.join(RESULTS, "context_ablation.json"))
  with open(os.path.join(RESULTS, "verdicts.json"), "w") as f:
    json.dump(verdicts, f, indent=1)
  for v in verdicts:
    print(f"{v['verdict']:>15}  {v['claim']}  ({v['test']}, p={v.get('p_value')})")


if __name__ == "__main__":
  main()
