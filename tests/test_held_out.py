"""The one held-out rule (`data.held_out.held_out_counts`), used by text: and hf:, against the two
rules it replaced: every split that either wrote before is written the same, so data prepared by an
earlier version keeps its splits (and its cache key)."""

import random

import pytest

from efficient_lm.data import hf_datasets
from efficient_lm.data import held_out
from efficient_lm.data import text_files


def _old_text_counts(n, validation_fraction, test_fraction):
  """text_files.held_out_counts before the merge (files, n >= 3)."""
  fractions = {'validation': validation_fraction, 'test': test_fraction}
  counts = {s: max(1, round(f * n)) if f > 0 else 0 for s, f in fractions.items()}
  while sum(counts.values()) > n - 1:
    largest = max(counts, key=lambda s: (counts[s], s))
    counts[largest] -= 1
  return counts


def _old_hf_counts(num_rows, fractions):
  """hf_datasets.held_out_counts before the merge (rows; `fractions` only the splits above 0,
  and a DataError where the counts left train no row)."""
  return {split: max(1, round(f * num_rows)) for split, f in fractions.items()}


@pytest.mark.parametrize('seed', range(3))
def test_the_one_rule_keeps_both_old_rules(seed):
  rng = random.Random(seed)
  for _ in range(500):
    n = rng.randint(1, 80)
    fv = rng.choice([0.0, rng.uniform(0, 0.6)])
    ft = rng.choice([0.0, rng.uniform(0, 0.99 - fv)])
    counts = held_out.held_out_counts(n, {'validation': fv, 'test': ft})
    if n >= 3:  # the text rule (by file: 3 files or more)
      assert counts == _old_text_counts(n, fv, ft)
    given = {s: f for s, f in (('validation', fv), ('test', ft)) if f > 0}
    old = _old_hf_counts(n, given)
    new = held_out.held_out_counts(n, given)
    if n - sum(old.values()) >= 1:  # where the hf rule prepared a dataset: the same rows
      assert new == old
    else:  # where it refused: now the largest share gives way, or (too few rows) still refused
      assert (n - sum(new.values()) >= 1) == (n > len(given))
    assert all((counts[s] >= 1) == (f > 0) for s, f in (('validation', fv), ('test', ft)))


def test_both_sources_use_it():
  assert text_files.held_out_counts is held_out.held_out_counts
  assert hf_datasets.held_out_counts is held_out.held_out_counts
  # Split sizes of prepared data, by file and by row, as before: 20 files / rows at 5% + 5%.
  files = text_files.assign_files([f'f{i}.txt' for i in range(20)], validation_fraction=0.05,
                                  test_fraction=0.05)
  assert {s: len(v) for s, v in files.items()} == {'train': 18, 'validation': 1, 'test': 1}
  rows = hf_datasets.held_out_rows(1000, {'validation': 0.05, 'test': 0.01})
  assert {s: len(v) for s, v in rows.items()} == {'train': 940, 'validation': 50, 'test': 10}
  assert held_out.held_out_counts(4, {'validation': 0.49, 'test': 0.49}) == {
      'validation': 1, 'test': 2}  # hf: refused before (4 rows, 2 + 2 held out); now train keeps 1
