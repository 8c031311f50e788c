"""The sixth stage's registered studies decided as registered: MQAR recall claims read from
long_range's results, an equivalence (TOST) against the margin the registration states, two-sided
claims that read "differ" with the arm ahead, and controls sized by their power."""

import numpy as np
import pytest

from efficient_lm.evaluation import stats


def _mqar_runs(tmp_path, accuracy_by_model, seeds, *, code, steps=1000):
  """long_range.json's `runs` for (model, seed) with answers correct at the given rate in every
  distance bin (a model's rate may be a function of the distance)."""
  rng = np.random.default_rng(0)
  n = 4096
  position = rng.integers(128, 192, n)
  distance = rng.integers(21, 129, n)
  keep = position - distance + 1 < 128
  position, distance = position[keep], distance[keep]
  runs = {}
  for model, accuracy in accuracy_by_model.items():
    for seed in seeds:
      p = accuracy(distance, seed) if callable(accuracy) else np.full(len(distance), accuracy)
      path = tmp_path / f"{model}@{seed}.npz"
      np.savez(path, sequence=np.arange(len(position)) // 8, position=position, distance=distance,
               correct=rng.random(len(position)) < p)
      runs[f"{model}@{seed}"] = {"model": model, "seed": seed, "steps": steps, "code": code,
                                 "queries_file": str(path)}
  return {"runs": runs}, distance


def test_mqar_recall_claims_read_recall_at_their_distances_and_differ_with_the_arm_ahead(tmp_path):
  from experiments import registration, verdicts  # pylint: disable=import-outside-toplevel
  study = registration.studies()["mqar_recall"]
  commit = registration.study_commit(study)
  assert commit is not None and study["seeds"] == [5, 6, 7, 8, 9]
  # π recalls everything; the window recalls within its reach (d <= 32) and is at chance past it.
  window = lambda d, seed: np.where(d <= 32, 0.95, 1 / 16)
  found, distance = _mqar_runs(tmp_path, {"pi_attention": 0.9, "sliding_window": window,
                                          "bcmt": 0.2, "honly": 1 / 16}, study["seeds"], code=commit)
  rows = {r["id"]: r for r in verdicts.registered_claims({"mqar_recall": found})
          if r["study"] == "mqar_recall"}
  pi = rows["mqar_pi_past_window"]
  assert pi["seeds"] == 5 and pi["primary"]
  # Per seed: the accuracy over the queries at distances 33-128 only.
  judged = (distance >= 33) & (distance < 129)
  assert all(e["b"] < 0.15 for e in pi["per_seed"]) and all(e["a"] > 0.85 for e in pi["per_seed"])
  assert pi["difference"] == pytest.approx(0.9 - 1 / 16, abs=0.03) and judged.sum() > 1000
  assert pi["verdict"] == "differ" and pi["ahead"] == "pi_attention"
  from experiments import claims  # pylint: disable=import-outside-toplevel
  assert claims.verdict_cell(pi) == "**differ**, pi_attention ahead"
  bcmt = rows["mqar_bcmt_past_block"]
  assert bcmt["verdict"] == "differ" and bcmt["ahead"] == "bcmt"
  assert "no path to any pair" in bcmt["measured"]  # HOnly at chance by construction, said so
  # A window that does not recall inside its own one-hop reach is not trained: not comparable.
  untrained, _ = _mqar_runs(tmp_path, {"pi_attention": 0.9, "sliding_window": 0.2},
                            study["seeds"], code=commit)
  row = {r["id"]: r for r in verdicts.registered_claims({"mqar_recall": untrained})
         if r["study"] == "mqar_recall"}["mqar_pi_past_window"]
  assert row["verdict"] == "not comparable" and row["note"].startswith("not trained: sliding_window@5")
  # Runs from before the registration do not count: pending, not decided.
  early, _ = _mqar_runs(tmp_path, {"pi_attention": 0.9, "sliding_window": window}, study["seeds"],
                        code="010e34b (snapshot)")
  row = {r["id"]: r for r in verdicts.registered_claims({"mqar_recall": early})
         if r["study"] == "mqar_recall"}["mqar_pi_past_window"]
  assert row["seeds"] == 0 and row["note"].startswith("pending")


def _table_rows(seeds, loss_a, loss_b, code):
  rows = {}
  for seed in seeds:
    for key, loss in (("bcmt:256", loss_a(seed)), ("bcmt:honly256", loss_b(seed))):
      rows[f"{key}@{seed}"] = {"config_key": key, "seed": seed, "eval_loss": loss, "code": code,
                               "scores": {}, "key": f"{key}@{seed}"}
  return {"tables": {"bcmt": {"rows": rows}}}


def test_the_bcmt_honly_equivalence_is_decided_by_tost_at_its_registered_margin():
  from experiments import registration, verdicts  # pylint: disable=import-outside-toplevel
  study = registration.studies()["bcmt_honly_equivalence"]
  commit = registration.study_commit(study)
  spec = study["claims"][0]
  assert spec["kind"] == "equivalence" and spec["margin"] == 0.02 and len(study["seeds"]) == 8
  noise = dict(zip(study["seeds"], [0.004, -0.003, 0.002, -0.001, 0.003, -0.004, 0.001, -0.002]))
  close = _table_rows(study["seeds"], lambda s: 4.6 + noise[s], lambda s: 4.6, commit)
  row = [r for r in verdicts.registered_claims({"bcmt_honly_equivalence": close})
         if r["study"] == "bcmt_honly_equivalence"][0]
  assert row["verdict"] == "equivalent" and row["margin"] == 0.02 and row["ahead"] is None
  assert row["interval"] == "90% (TOST)" and row["ci_low"] > -0.02 and row["ci_high"] < 0.02
  apart = _table_rows(study["seeds"], lambda s: 4.65 + noise[s], lambda s: 4.6, commit)
  row = [r for r in verdicts.registered_claims({"bcmt_honly_equivalence": apart})
         if r["study"] == "bcmt_honly_equivalence"][0]
  assert row["verdict"] == "not equivalent"
  six = _table_rows(study["seeds"][:6], lambda s: 4.6 + noise[s], lambda s: 4.6, commit)
  row = [r for r in verdicts.registered_claims({"bcmt_honly_equivalence": six})
         if r["study"] == "bcmt_honly_equivalence"][0]
  assert row["note"] == "pending: 6 of 8 planned seeds"


def test_proportion_interval_and_control_hand_examples():
  low, high = stats.proportion_interval(95, 100)
  assert (low, high) == pytest.approx((0.8882, 0.9785), abs=1e-4)  # Wilson, z = 1.96
  assert stats.normal_quantile(0.975) == pytest.approx(1.959964, abs=1e-6)
  assert stats.proportion_control(380, 400, 0.9, "at_least")["verdict"] == "holds"
  assert stats.proportion_control(340, 400, 0.9, "at_least")["verdict"] == "fails"
  assert stats.proportion_control(18, 20, 0.9, "at_least")["verdict"] == "not decided"
  assert stats.proportion_control(4, 400, 0.1, "at_most")["verdict"] == "holds"
  with pytest.raises(ValueError):
    stats.proportion_control(1, 2, 0.5, "above")


def test_control_powers_against_simulation():
  """The exact powers agree with simulated draws; the minimum over 60 cells of 20 holds for a
  model truly at 0.95 in every cell about 1% of the time, the pooled share's interval near always."""
  rng = np.random.default_rng(0)
  cells = rng.binomial(20, 0.95, size=(20000, 60)) / 20
  simulated = float((cells.min(axis=1) >= 0.9).mean())
  exact = stats.every_cell_power(20, 60, 0.95, 0.9)
  assert exact == pytest.approx(0.009, abs=0.001) and simulated == pytest.approx(exact, abs=0.003)
  draws = rng.binomial(400, 0.95, size=20000)
  holds = np.mean([stats.proportion_control(int(k), 400, 0.9, "at_least")["verdict"] == "holds"
                   for k in draws[:4000]])
  power = stats.proportion_control_power(400, 0.95, 0.9, "at_least")
  assert power == pytest.approx(holds, abs=0.01) and power > 0.95


def test_the_needle_studys_min_cell_controls_carry_their_power():
  """The registered 'every cell >= 0.9' controls are reported with the chance they hold for a
  model that truly meets them (0.95 in every cell, 3 seeds of 20 cells of 20: about 0.009)."""
  from experiments import verdicts  # pylint: disable=import-outside-toplevel
  committed = verdicts.decide_all(**verdicts.load_all())
  dense = {c["id"]: c for c in committed["registered_controls"]}["needle_dense_everywhere"]
  assert dense["power"]["cells"] == 20 and dense["power"]["per_cell"] == 20
  assert dense["power"]["holds"] == pytest.approx(0.009, abs=0.001)
  assert "0.009 (a share of 0.95 in each of 20 cells of 20, 3 seeds)" in verdicts.render_registered(committed)
