"""The training loop end to end on a tiny fixture corpus: loss falls, files, resume, mismatch."""

import json
import math
import os
import shutil

import jax.numpy as jnp

import numpy as np
import pytest


from conftest import build
from efficient_lm.config.mesh import MeshConfig
from efficient_lm.parallel import sharding
from efficient_lm.training import loop as train
from efficient_lm.state import workdir as workdir_lib
from efficient_lm.training import evaluate as training_evaluate
from efficient_lm.training import step as train_step
from efficient_lm.training import metrics


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture
def finished_run(tiny_config, tmp_path_factory, _run_cache={}):
  """One 40-step run shared by the tests below (module-level cache: the factory is per-test)."""
  if not _run_cache:
    workdir = str(tmp_path_factory.mktemp("run"))
    _run_cache["run"] = workdir, train.train_and_evaluate(build(tiny_config(num_steps=40)), workdir)
  return _run_cache["run"]


def test_loss_falls_and_workdir_has_everything(finished_run):
  workdir, summary = finished_run
  records = read_metrics(workdir)
  train_lines = [r for r in records if "loss" in r]
  eval_lines = [r for r in records if "eval_loss" in r]
  assert [r["step"] for r in train_lines] == [5, 10, 15, 20, 25, 30, 35, 40]
  assert train_lines[-1]["loss"] < train_lines[0]["loss"] - 0.5
  assert all(r["tokens_per_sec"] > 0 and r["learning_rate"] > 0 for r in train_lines)
  assert [r["step"] for r in eval_lines] == [20, 40]
  assert eval_lines[-1]["eval_loss"] < eval_lines[0]["eval_loss"]
  last = eval_lines[-1]
  assert math.isclose(last["eval_perplexity"], math.exp(last["eval_loss"]), rel_tol=1e-6)
  assert summary["eval_bits_per_byte"] == pytest.approx(last["eval_bits_per_byte"])
  assert summary["step"] == 40
  assert sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints"))) == [20, 30, 40]
  assert os.path.isfile(os.path.join(workdir, "tokenizer.model"))
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["model"]["d_model"] == 32
  events = os.listdir(os.path.join(workdir, "tensorboard"))
  assert any(name.startswith("events.out.tfevents") for name in events)
  assert summary["sample"].startswith("ROMEO:\n") and len(summary["sample"]) > len("ROMEO:\n")


@pytest.mark.slow
def test_more_steps_continue_from_the_latest_checkpoint(tiny_config, tmp_path, caplog):
  workdir = str(tmp_path / "extended")
  train.train_and_evaluate(build(tiny_config(num_steps=20)), workdir)
  with caplog.at_level("WARNING", logger="efficient_lm.training.loop"):
    summary = train.train_and_evaluate(build(tiny_config(num_steps=30)), workdir)
  steps = [r["step"] for r in read_metrics(workdir) if "loss" in r]
  assert steps == [5, 10, 15, 20, 25, 30]  # appended to the same file, continuing at step 21
  assert summary["step"] == 30
  # The cosine schedule ended at 10% of the peak at step 20; over 30 steps step 20 is higher.
  jumps = [r.getMessage() for r in caplog.records if "learning rate jumps" in r.getMessage()]
  assert len(jumps) == 1 and "0.0003 in the checkpoint's run, 0.00123 now" in jumps[0], jumps


@pytest.mark.slow
def test_resumed_run_equals_uninterrupted_run(finished_run, tiny_config, tmp_path):
  """Lose everything after checkpoint 20 of a 40-step run; rerunning ends at the same loss."""
  workdir = str(tmp_path / "interrupted")
  shutil.copytree(finished_run[0], workdir)
  for step in ("30", "40"):
    shutil.rmtree(os.path.join(workdir, "checkpoints", step))
  summary = train.train_and_evaluate(build(tiny_config(num_steps=40)), workdir)
  # The rows past the checkpoint resumed from are rerun, each step's once (not repeated).
  got = [(r["step"], r["loss"]) for r in read_metrics(workdir) if "loss" in r]
  want = [(r["step"], r["loss"]) for r in read_metrics(finished_run[0]) if "loss" in r]
  assert [step for step, _ in got] == [5, 10, 15, 20, 25, 30, 35, 40]
  assert got == want
  assert summary["eval_loss"] == finished_run[1]["eval_loss"]


def test_workdir_of_another_model_is_refused(finished_run, tiny_config):
  config = tiny_config(num_steps=50)
  config.model.d_model = 64
  with pytest.raises(workdir_lib.WorkdirMismatchError, match="parameter shapes differ"):
    train.train_and_evaluate(build(config), finished_run[0])


def test_bits_per_byte_by_hand():
  # 100 nats over 50 bytes: 100 / (ln 2 * 50) bits per byte.
  assert metrics.bits_per_byte(100.0, 50) == pytest.approx(2.0 / math.log(2.0))

  # A uniform model over V tokens scores log(V) nats per target: bpb = n log2(V) / bytes.
  V, T = 16, 8

  class Corpus:
    def eval_batches(self, split, batch_size):
      weights = np.ones((2, T), np.float32)
      weights[1, 5:] = 0.0  # 3 padded positions
      yield {"inputs": np.zeros((2, T), np.int32), "targets": np.ones((2, T), np.int32),
             "weights": weights}

    def num_bytes(self, split):
      return 39

  def uniform_eval_step(params, batch):
    return train_step.weighted_nll(jnp.zeros((2, T, V)), batch["targets"], batch["weights"])

  mesh = sharding.make_mesh(MeshConfig.from_mapping(dict(data=1, fsdp=1, context=1)))  # one device
  result = training_evaluate.evaluate(uniform_eval_step, None, Corpus(), "validation", 2, mesh)
  assert result["eval_loss"] == pytest.approx(math.log(V))
  assert result["eval_bits_per_byte"] == pytest.approx(13 * math.log2(V) / 39)


def test_weighted_nll_scores_the_last_positions():
  """A model returning logits for its last T' positions is scored on the last T' targets."""
  V = 5
  targets = jnp.array([[0, 1, 2, 3]])
  weights = jnp.ones((1, 4))
  logits = jnp.full((1, 2, V), -30.0).at[0, 0, 2].set(30.0).at[0, 1, 3].set(30.0)
  nll, weight = train_step.weighted_nll(logits, targets, weights)
  assert float(weight) == 2.0
  assert float(nll) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("name,preset,fields", [
    ("pi_attention", None, dict(window=8, period=8, num_skips=2)),
    ("bcmt", None, dict(block_size=8)),
    ("ecp", None, dict(num_segments=4)),
    ("perceiver_ar", "compressed", dict(num_latents=16, compression=4)),
])
def test_every_family_trains_through_the_loop(name, preset, fields, tiny_config, tmp_path):
  """The loop is model-agnostic: each family trains, checkpoints and evaluates; the final eval equals
  a fresh evaluation of the saved checkpoint (restored into a new model). Learning itself is tested
  on a task only attention solves (test_learning.py)."""
  from efficient_lm.evaluation import scoring
  config = tiny_config(name, preset, num_steps=10, eval_every=10, checkpoint_every=10, sample_tokens=4)
  config.model.update(fields)
  workdir = str(tmp_path / name)
  summary = train.train_and_evaluate(build(config), workdir)
  assert summary["step"] == 10 and [r["step"] for r in read_metrics(workdir) if "loss" in r] == [5, 10]
  again = scoring.evaluate_workdir(workdir)
  assert again["step"] == 10
  assert again["loss"] == pytest.approx(summary["eval_loss"], rel=1e-5)
  assert again["bits_per_byte"] == pytest.approx(summary["eval_bits_per_byte"], rel=1e-5)


def test_the_first_logged_rate_is_the_first_steps(monkeypatch):
  """Logged right after the first step (whose clock was reset to keep compilation out of later
  rates), the rate is that step's own, compilation included: never tokens over ~0 seconds."""
  now = [100.0]
  monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
  progress = metrics.Progress(0, 10, tokens_per_step=1000)
  now[0] += 4.0  # the first step, compilation included
  progress.reset_clock(1)
  assert progress.tokens_per_sec(1) == pytest.approx(250.0)
  now[0] += 0.5
  assert progress.tokens_per_sec(2) == pytest.approx(2000.0)
