"""The one batched scoring loop (`evaluation.score_rows`): it equals a row-by-row reference, pads
only its last batch, never yields a padding row, and is the only batching of score rows."""

import contextlib
import os
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import REPO
from efficient_lm import models
from efficient_lm.data import corpus as corpus_lib
from efficient_lm.evaluation import score_rows
from test_models import tiny_model_config

EOS = 1


def _random_rows(num_rows: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
  """Rows of random tokens (some end-of-document tokens: several documents a row), random weights
  with unscored positions, and their document ids."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(num_rows):
    inputs = rng.integers(2, vocab, seq_len).astype(np.int32)
    inputs[rng.random(seq_len) < 0.1] = EOS
    inputs[0] = EOS
    rows.append({"inputs": inputs, "targets": rng.integers(0, vocab, seq_len).astype(np.int32),
                 "weights": (rng.random(seq_len) < 0.7).astype(np.float32),
                 "segment_ids": corpus_lib.document_ids(inputs[None], EOS)[0]})
  return rows


@pytest.mark.parametrize("name", ["dense", "perceiver_ar"])  # (a few seconds each)
def test_the_loop_equals_a_row_by_row_reference_with_a_last_partial_batch(name):
  """7 rows in batches of 3 (the last holds one real row and two of padding): each row's NLL per
  position, its sum, its weights and its argmax equal the model run on that row alone."""
  cfg = tiny_model_config(name)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  rows = _random_rows(7, cfg.seq_len, cfg.vocab_size)
  step = score_rows.make_score_step(graphdef, predictions=True)
  got = list(score_rows.score_rows(step, params, rows, batch_size=3))
  assert len(got) == len(rows)
  forward = jax.jit(lambda p, x, s: nnx.merge(graphdef, p)(x, segment_ids_BT=s))
  for row, scored in zip(rows, got):
    assert scored.row["inputs"].tolist() == row["inputs"].tolist()  # in order
    logits_TV = np.asarray(forward(params, row["inputs"][None], row["segment_ids"][None])[0],
                           np.float64)
    T = logits_TV.shape[0]
    assert len(scored.token_nll) == T <= cfg.seq_len  # Perceiver-AR: its latents only
    nll_T = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
        logits_TV, row["targets"][-T:]))
    np.testing.assert_allclose(scored.token_nll, nll_T, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(scored.weights, row["weights"][-T:])
    assert scored.nll == pytest.approx(float(np.sum(nll_T * row["weights"][-T:])), rel=2e-5)
    assert scored.scored == float(row["weights"][-T:].sum())
    np.testing.assert_array_equal(scored.predicted, logits_TV.argmax(-1))
  assert any(r.nll > 0 for r in got) and len({round(r.nll, 4) for r in got}) == len(got)


def test_padding_rows_fill_only_the_last_batch_and_never_reach_a_result():
  """A step that echoes its inputs: every batch has batch_size rows (one compiled shape), the
  padding row fills the last one only, and no result comes from it."""
  seen = []

  def echo_step(params, batch):
    del params
    seen.append(batch["inputs"].copy())
    return {"token_nll": batch["inputs"].astype(np.float32)}

  rows = [{"inputs": np.full(4, i, np.int32), "targets": np.zeros(4, np.int32),
           "weights": np.ones(4, np.float32)} for i in range(7)]
  pad = {"inputs": np.full(4, -7, np.int32), "targets": np.zeros(4, np.int32),
         "weights": np.zeros(4, np.float32)}
  got = list(score_rows.score_rows(echo_step, None, iter(rows), batch_size=3, pad_row=pad))
  assert [r.token_nll[0] for r in got] == list(range(7))  # every real row once, in order
  assert all(-7 not in r.row["inputs"] and -7 not in r.token_nll for r in got)
  assert [b.shape for b in seen] == [(3, 4)] * 3
  assert [b[:, 0].tolist() for b in seen] == [[0, 1, 2], [3, 4, 5], [6, -7, -7]]
  # the default padding: zeros shaped as the first row, weight 0
  seen.clear()
  got = list(score_rows.score_rows(echo_step, None, rows[:4], batch_size=3))
  assert [r.token_nll[0] for r in got] == [0, 1, 2, 3] and seen[-1][:, 0].tolist() == [3, 0, 0]
  assert list(score_rows.score_rows(echo_step, None, [], batch_size=3)) == []
  with pytest.raises(ValueError, match="pad_row must have weight 0"):
    list(score_rows.score_rows(echo_step, None, rows, batch_size=3,
                               pad_row={**pad, "weights": np.ones(4, np.float32)}))


def test_batches_fill_the_last_batch_and_count_its_real_items():
  assert list(score_rows.batches(range(7), 3, pad=-1)) == [
      ([0, 1, 2], 3), ([3, 4, 5], 3), ([6, -1, -1], 1)]
  assert list(score_rows.batches([], 3, pad=-1)) == []
  with pytest.raises(ValueError, match="batch_size=0"):
    list(score_rows.batches(range(3), 0, pad=-1))


def test_the_score_step_is_built_only_where_its_rows_go_through_the_one_loop():
  """Every library file that builds the score step scores through `score_rows` (no loop of its
  own), and no file but the loop's fetches a score step's outputs."""
  builders, fetchers = [], []
  for root, _, files in os.walk(os.path.join(REPO, "efficient_lm")):
    for f in files:
      if not f.endswith(".py"):
        continue
      path = os.path.join(root, f)
      with open(path, encoding="utf-8") as fh:
        src = fh.read()
      rel = os.path.relpath(path, REPO)
      if re.search(r"make_score_step\(", src) and not rel.endswith("score_rows.py"):
        builders.append(rel)
        assert re.search(r"score_rows\(", src), f"{rel} builds a score step but not the loop"
      if re.search(r"device_get\(\s*(self\.)?_?(score_)?step\(", src):
        fetchers.append(rel)
  assert len(builders) >= 4, builders  # scoring, api, the harness adapter, extrapolate
  assert not fetchers, f"a score loop of its own: {fetchers}"


def test_a_long_loop_says_how_many_rows_are_scored(monkeypatch):
  """With `progress`, the rows run inside one `runtime.progress` phase whose status counts them."""
  phases = []

  @contextlib.contextmanager
  def phase(what, status=None):
    phases.append((what, status))
    yield

  monkeypatch.setattr(score_rows.progress_lib, "phase", phase)
  rows = [{"inputs": np.full(4, i, np.int32), "weights": np.ones(4, np.float32)} for i in range(5)]
  step = lambda params, batch: {"token_nll": batch["inputs"].astype(np.float32)}
  got = score_rows.score_rows(step, None, rows, batch_size=2, progress="scoring", total=5)
  assert next(got).token_nll[0] == 0
  ((what, status),) = phases
  assert what == "scoring" and status() == "1 of 5 rows scored"
  assert len(list(got)) == 4 and status() == "5 of 5 rows scored"
  assert len(phases) == 1  # one phase for the whole loop
