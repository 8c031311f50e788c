"""The readouts that decide long-range claims: the context ablation (exact nulls where the model's
reach is short), recall by distance on MQAR through the evaluator, and one scorer whose memory at
long context is the train step's (chunked loss: no [B, T, V] logits)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import build
from efficient_lm import models
from efficient_lm.data import mqar
from efficient_lm.evaluation import scoring
from efficient_lm.state import train_state
from efficient_lm.training import loop as train
from efficient_lm.training import step_memory
from test_models import tiny_model_config


def stream(length: int, vocab: int, eos: int = 1, doc: int = 50, seed: int = 0) -> np.ndarray:
  """A token stream of documents of `doc` tokens between end-of-document tokens."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, vocab, length).astype(np.int32)
  tokens[::doc] = eos
  return tokens


def ablation(cfg, tokens, *, context=32, stride=8, ablate=16, method="swap"):
  model = models.create(cfg, rngs=nnx.Rngs(0))
  return scoring.score_stream(model, tokens, context=context, stride=stride, batch_size=4,
                              num_bytes=len(tokens), eos_id=1, pad_id=0, seq_len=cfg.seq_len,
                              ablate_context=ablate, ablate_method=method)["ablation"]


@pytest.mark.parametrize("method", ["swap", "eos"])
@pytest.mark.parametrize("name,fields", [
    ("sliding_window", dict(window=3, num_layers=2)),  # receptive field 2 x 2 = 4 < 16 - 8
    ("honly", dict(block_size=8)),                      # blocks of 8: block-aligned windows
])
def test_short_reach_models_are_exact_nulls(name, fields, method):
  tokens = stream(32 * 8 + 1, 64)  # n a multiple of the stride: every window full
  result = ablation(tiny_model_config(name, **fields), tokens, method=method)
  assert result["all"]["delta"] == 0.0 and result["all"]["tokens"] == 32 * 8
  assert result["all"]["ci_low"] == 0.0 == result["all"]["ci_high"]
  assert result["all"]["full_loss"] == result["all"]["ablated_loss"] > 0
  assert result["kept_context"] == [8, 15] and result["method"] == method


def test_swap_puts_text_of_another_document_beyond_the_cut():
  """The swap ablation: inputs more than N before a window's end become a contiguous run of the
  split's text from documents that hold none of the kept inputs or scored targets; the kept
  inputs, the targets and the positions are untouched; the run does not depend on the batching."""
  tokens = stream(400 + 1, 64, doc=50)
  doc = np.cumsum(tokens == 1)
  layout = dict(context=32, stride=8, seq_len=32, right_align=False, eos_id=1, pad_id=0)
  windows = np.arange(50)
  starts, relaxed = scoring.swap_starts(tokens, windows, context=32, stride=8, ablate=16, eos_id=1,
                                        seed=3)
  assert not relaxed.any()  # 8 documents: every window has text of a document it does not hold
  full = scoring.window_batch(tokens, windows, **layout)
  swapped = scoring.window_batch(tokens, windows, ablate=16, swap_from=starts, **layout)
  for k in ("targets", "weights", "window_positions", "stream_positions"):
    np.testing.assert_array_equal(full[k], swapped[k])
  checked = 0
  for b, w in enumerate(windows):
    stream_T = full["stream_positions"][b]
    end = w * 8 + 8
    replaced = (stream_T >= 0) & (stream_T < end - 16)
    np.testing.assert_array_equal(swapped["inputs"][b][~replaced], full["inputs"][b][~replaced])
    if not replaced.any():
      assert starts[b] == -1
      continue
    run = np.arange(starts[b], starts[b] + replaced.sum())
    np.testing.assert_array_equal(swapped["inputs"][b][replaced], tokens[run])
    assert not set(doc[run]) & set(range(doc[end - 16], doc[end] + 1))
    checked += 1
  assert checked == 50 - 2  # windows 0 and 1 (ends 8 and 16) have nothing beyond 16 back
  # Reproducible, and the same run for a window whatever batch it is in.
  again, _ = scoring.swap_starts(tokens, windows[7:11], context=32, stride=8, ablate=16, eos_id=1,
                                 seed=3)
  np.testing.assert_array_equal(again, starts[7:11])
  assert not np.array_equal(starts, scoring.swap_starts(tokens, windows, context=32, stride=8,
                                                        ablate=16, eos_id=1, seed=4)[0])


def test_swap_across_the_boundary_of_two_documents_avoids_the_targets_documents():
  """Two documents (the plays' validation split): a window whose kept inputs hold both takes its
  swapped-in text from the document its scored targets are not in (relaxed); one whose targets
  hold both, from the one its last target is not in; the rest avoid every document they hold."""
  tokens = np.concatenate([[1], np.full(60, 5), [1], np.full(60, 9)]).astype(np.int32)  # docs 1, 2
  doc = np.cumsum(tokens == 1)
  windows = np.arange(scoring.num_windows(len(tokens) - 1, 8))
  starts, relaxed = scoring.swap_starts(tokens, windows, context=32, stride=8, ablate=16, eos_id=1)
  kinds = set()
  for w, (start, r) in enumerate(zip(starts, relaxed)):
    first, end = w * 8, min(w * 8 + 8, len(tokens) - 1)
    if start < 0:
      continue
    run = set(doc[start:start + end - 16 - max(first - 24, 0)])
    held, targets = set(doc[end - 16:end + 1]), set(doc[first + 1:end + 1])
    assert doc[end] not in run and r == (run & held != set() or len(held) > 1), w
    if not r:
      assert not run & held
    elif len(targets) == 1:
      assert not run & targets
    kinds.add((r, len(held), len(targets)))
  assert kinds == {(False, 1, 1), (True, 2, 1), (True, 2, 2)}


def test_swap_needs_another_document():
  one_document = np.concatenate([[1], np.arange(3, 67) % 60 + 3]).astype(np.int32)
  with pytest.raises(scoring.EvalError, match="or use --ablate_method=eos"):
    ablation(tiny_model_config("dense"), one_document)
  with pytest.raises(scoring.EvalError, match="ablate_method='shuffle' is not a known ablation"):
    ablation(tiny_model_config("dense"), stream(65, 64), method="shuffle")


@pytest.mark.parametrize("name,fields", [("dense", {}), ("perceiver_ar", dict(num_latents=8))])
def test_a_long_reach_model_is_not_a_null(name, fields):
  """Dense attention (and Perceiver-AR's latents, right-aligned windows) sees what the ablation
  takes away: the difference is not 0, with an interval over documents, per bucket of the
  position in the document."""
  tokens = stream(32 * 8 + 1, 64, doc=40)
  result = ablation(tiny_model_config(name, **fields), tokens)
  overall = result["all"]
  assert overall["delta"] != 0.0 and overall["ci_low"] <= overall["delta"] <= overall["ci_high"]
  assert overall["delta"] == pytest.approx(overall["ablated_loss"] - overall["full_loss"])
  assert overall["documents"] > 1 and 0.0 <= overall["p_value"] <= 1.0
  buckets = result["by_position_in_document"]
  assert [b["low"] for b in buckets] == [0, 16, 32, 64] and buckets[-1]["high"] is None
  assert sum(b["tokens"] for b in buckets) == overall["tokens"]


def test_ablation_arguments_are_checked():
  with pytest.raises(scoring.EvalError, match="ablate_context=4 must be at least --stride=8"):
    ablation(tiny_model_config("dense"), stream(65, 64), ablate=4)


@pytest.mark.slow
def test_recall_by_distance_through_the_evaluator(tiny_config, tmp_path):
  """A tiny run on MQAR: the workdir records the task, and the evaluator reports accuracy per
  distance bin with its standard error and count (every query of the split, once)."""
  config = tiny_config("pi_attention", num_steps=4, log_every=2, eval_every=4, checkpoint_every=4,
                       sample_tokens=0)
  config.data.update(dataset="mqar:seq_len=64,latents=16,queries=2,pairs=6,min_distance=6,"
                     "keys=16,values=16,filler=16,eval_sequences=24", seq_len=64, vocab_size=64,
                     archive="", archive_sha256="")
  workdir = str(tmp_path / "mqar")
  summary = train.train_and_evaluate(build(config), workdir)
  assert summary["step"] == 4 and np.isfinite(summary["eval_loss"])
  assert json.load(open(os.path.join(workdir, "config.json")))["data"]["vocab_size"] == 51
  result = scoring.evaluate_workdir(workdir, split="validation", per_query=True)
  recall = result["recall"]
  assert recall["count_all"] == 24 * 2 == sum(recall["count"])
  # Every answer once, where the task put it: its sequence, input position and distance.
  queries = result["queries"]
  task = mqar.parse(config.data.dataset)
  expected = [(i, q, d) for i in range(24)
              for q, d in enumerate(mqar.sequence(task, "validation", i)[1]) if d >= 0]
  assert sorted(zip(queries["sequence"], queries["position"], queries["distance"])) == expected
  assert queries["correct"].mean() * 48 == pytest.approx(recall["accuracy_all"] * 48)
  for accuracy, error, count in zip(recall["accuracy"], recall["stderr"], recall["count"]):
    if count:
      assert 0.0 <= accuracy <= 1.0
      assert error == pytest.approx(np.sqrt(accuracy * (1 - accuracy) / count))
  assert result["scored_tokens"] == 48


@pytest.mark.slow
def test_the_evaluator_at_long_context_stays_within_the_train_steps_memory():
  """The score step at 131,072 tokens scores through the chunked loss: its temporaries are below
  the train step's (whose loss is chunked too), far from the 4 GiB of [1, T, 8192] logits."""
  T, V = 131072, 8192
  from conftest import load_config  # pylint: disable=import-outside-toplevel
  from test_models import FAMILY_FIELDS  # pylint: disable=import-outside-toplevel
  full = load_config("sliding_window")
  full.model.update(dict(d_model=32, num_layers=2, num_heads=4, mlp_ratio=2,
                         **dict(FAMILY_FIELDS.get("sliding_window", {}), window=64, seq_chunk=8192)))
  full.data.update(seq_len=T, batch_size=1, vocab_size=V)
  full.model.update(remat="block")
  built = train_state.build(build(full), abstract=True)
  train_temp = step_memory.compile_train_step(build(full), built).memory_analysis().temp_size_in_bytes
  step = scoring.make_score_step(built.graphdef, loss_chunk=full.train.loss_chunk)
  batch = {k: jax.ShapeDtypeStruct((1, T), d) for k, d in (
      ("inputs", jnp.int32), ("targets", jnp.int32), ("weights", jnp.float32),
      ("window_positions", jnp.int32))}
  score_temp = step.lower(built.state.params, batch).compile().memory_analysis().temp_size_in_bytes
  assert score_temp < train_temp < 2**30
