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

from efficient_lm import models
from efficient_lm.data import mqar
from efficient_lm import scoring
from efficient_lm import train
from efficient_lm import train_state
from efficient_lm import step_memory
from test_models import tiny_model_config


def stream(length: int, vocab: int, eos: int = 1, doc: int = 50, seed: int = 0) -> np.ndarray:
  """A token stream of documents of `doc` tokens between end-of-document tokens."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, vocab, length).astype(np.int32)
  tokens[::doc] = eos
  return tokens


def ablation(cfg, tokens, *, context=32, stride=8, ablate=16):
  model = models.create(cfg, rngs=nnx.Rngs(0))
  return scoring.score_stream(model, tokens, context=context, stride=stride, batch_size=4,
                              num_bytes=len(tokens), eos_id=1, pad_id=0, seq_len=cfg.seq_len,
                              ablate_context=ablate)["ablation"]


@pytest.mark.parametrize("name,fields", [
    ("sliding_window", dict(window=3, num_layers=2)),  # receptive field 2 x 2 = 4 < 16 - 8
    ("honly", dict(block_size=8)),                      # blocks of 8: block-aligned windows
])
def test_short_reach_models_are_exact_nulls(name, fields):
  tokens = stream(32 * 8 + 1, 64)  # n a multiple of the stride: every window full
  result = ablation(tiny_model_config(name, **fields), tokens)
  assert result["all"]["delta"] == 0.0 and result["all"]["tokens"] == 32 * 8
  assert result["all"]["ci_low"] == 0.0 == result["all"]["ci_high"]
  assert result["kept_context"] == [8, 15]


def test_a_long_reach_model_is_not_a_null():
  """Dense attention sees what the ablation takes away: the difference is not 0, with an
  interval over documents, per bucket of the position in the document."""
  tokens = stream(32 * 8 + 1, 64, doc=40)
  result = ablation(tiny_model_config("dense"), tokens)
  overall = result["all"]
  assert overall["delta"] != 0.0 and overall["ci_low"] <= overall["delta"] <= overall["ci_high"]
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
  summary = train.train_and_evaluate(config, workdir)
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
  config = tiny_model_config("sliding_window", window=64, seq_len=T, vocab_size=V, seq_chunk=8192)
  from conftest import load_config  # pylint: disable=import-outside-toplevel
  full = load_config("sliding_window")
  full.model.update(config)
  full.data.update(seq_len=T, batch_size=1, vocab_size=V)
  full.model.update(remat="block")
  built = train_state.build(full, abstract=True)
  train_temp = step_memory.compile_train_step(full, built).memory_analysis().temp_size_in_bytes
  step = scoring.make_score_step(built.graphdef, loss_chunk=full.train.loss_chunk)
  batch = {k: jax.ShapeDtypeStruct((1, T), d) for k, d in (
      ("inputs", jnp.int32), ("targets", jnp.int32), ("weights", jnp.float32),
      ("window_positions", jnp.int32))}
  score_temp = step.lower(built.state.params, batch).compile().memory_analysis().temp_size_in_bytes
  assert score_temp < train_temp < 2**30
