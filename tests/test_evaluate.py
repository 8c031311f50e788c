"""`efficient_lm.evaluate`: windows, scoring against train.evaluate and a direct reference, files, CLI."""

import json
import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import REPO, _tiny_sections, build, fast_first, load_config
from efficient_lm.config.data import DataConfig
from efficient_lm import data
from efficient_lm.cli import evaluate_command as evaluate
from efficient_lm.evaluation import scoring
from efficient_lm.inference.restore import restore
from efficient_lm.training import loop as train

# The module's trained fixture is built once: its tests run on one xdist worker (--dist=loadgroup).
pytestmark = pytest.mark.xdist_group("evaluate_runs")

NUM_LATENTS = 8


def _tiny(name, archive, data_dir, **model_overrides):
  config = load_config(name)
  for section, fields in _tiny_sections(archive, data_dir, dict(num_steps=20, sample_tokens=0)).items():
    config[section].update(fields)
  config.model.update(model_overrides)
  return config


@pytest.fixture(scope="module")
def runs(shakespeare_archive, tiny_data_dir, tmp_path_factory):
  """Two trained tiny workdirs (20 steps): dense, and Perceiver-AR with 8 latents of 32."""
  out = {}
  for name, overrides in (("dense", {}), ("perceiver_ar", {"num_latents": NUM_LATENTS})):
    config = _tiny(name, shakespeare_archive, tiny_data_dir, **overrides)
    workdir = str(tmp_path_factory.mktemp(name))
    train.train_and_evaluate(build(config), workdir)
    out[name] = workdir
  out["corpus"] = data.load(data.validate(DataConfig.from_mapping(config.data)))
  return out


def final_eval(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if "eval_loss" in r][-1]


# Windows (no model).

@pytest.mark.parametrize("n,context,stride,seq_len,right_align", [
    (100, 16, 4, 16, False), (101, 16, 4, 32, True), (37, 8, 8, 8, False), (5, 16, 3, 16, True),
    (64, 10, 7, 12, False)])
def test_every_target_is_scored_once_after_its_whole_window(n, context, stride, seq_len, right_align):
  tokens = np.random.default_rng(n).integers(3, 50, size=n + 1).astype(np.int32)
  windows = scoring.num_windows(n, stride)
  batch = scoring.window_batch(tokens, np.arange(windows + 2), context=context, stride=stride,
                                seq_len=seq_len, right_align=right_align, eos_id=2, pad_id=0)
  scored = []
  for w in range(windows + 2):
    weights, inputs, targets = batch["weights"][w], batch["inputs"][w], batch["targets"][w]
    if w >= windows:  # padding rows
      assert weights.sum() == 0
      continue
    start = max(0, w * stride - (context - stride))
    end = min(w * stride + stride, n)
    slots = np.arange(seq_len - (end - start), seq_len) if right_align else np.arange(end - start)
    np.testing.assert_array_equal(inputs[slots], tokens[start:end])
    np.testing.assert_array_equal(targets[slots], tokens[start + 1:end + 1])
    np.testing.assert_array_equal(batch["window_positions"][w][slots], np.arange(end - start))
    others = np.setdiff1d(np.arange(seq_len), slots)
    assert np.all(inputs[others] == (2 if right_align else 0)) and weights[others].sum() == 0
    hits = slots[weights[slots] > 0]
    scored += list(start + hits - slots[0])
    assert list(weights[slots]) == [float(p >= w * stride) for p in range(start, end)]
  assert sorted(scored) == list(range(n))  # each target position exactly once


def test_window_checks_name_the_flag_and_the_fix():
  ok = dict(seq_len=32, num_logits=32)
  with pytest.raises(scoring.EvalError, match=r"stride=16 must be at most context=8.*--stride"):
    scoring.check_windows(8, 16, **ok)
  with pytest.raises(scoring.EvalError, match=r"context=64 exceeds model.seq_len=32.*--context"):
    scoring.check_windows(64, 8, **ok)
  with pytest.raises(scoring.EvalError, match=r"context=0 must be a positive integer"):
    scoring.check_windows(0, 8, **ok)
  with pytest.raises(scoring.EvalError, match=r"stride=16 exceeds model.num_latents=8.*--stride"):
    scoring.check_windows(32, 16, seq_len=32, num_logits=8)
  scoring.check_windows(32, 32, seq_len=32, num_logits=8)  # the training eval's windows
  scoring.check_windows(24, 8, seq_len=32, num_logits=8)


# Scoring a workdir.

@pytest.mark.slow
def test_default_windows_equal_train_evaluate(runs):
  for name in ("dense", "perceiver_ar"):
    result = scoring.evaluate_workdir(runs[name])
    expected = final_eval(runs[name])
    assert result["step"] == expected["step"] == 20 and result["split"] == "validation"
    assert result["loss"] == pytest.approx(expected["eval_loss"], abs=1e-5)
    assert result["perplexity"] == pytest.approx(expected["eval_perplexity"], rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(expected["eval_bits_per_byte"], abs=1e-5)
    assert result["target_tokens"] == runs["corpus"].num_tokens("validation")
    assert result["devices"] == jax.local_device_count()
  # Perceiver-AR scores only the last 8 targets of each 32-token window (all of a short last one
  # that reaches its latents), and is charged that share of the bytes.
  n = runs["corpus"].num_tokens("validation")
  last = n - 32 * (scoring.num_windows(n, 32) - 1)
  assert result["scored_tokens"] == NUM_LATENTS * (n // 32) + max(0, last - (32 - NUM_LATENTS)) * (n % 32 > 0)


def _reference_nll(model, tokens, *, context, stride, seq_len, num_logits, eos_id):
  """Summed NLL of every target, each window run on its own: unpadded for a causal model,
  right-aligned after end-of-document tokens for Perceiver-AR."""
  graphdef, params = nnx.split(model)
  forward = jax.jit(lambda params, x: nnx.merge(graphdef, params)(x))
  n, total = len(tokens) - 1, 0.0
  for w in range(scoring.num_windows(n, stride)):
    start, end = max(0, w * stride - (context - stride)), min(w * stride + stride, n)
    window = tokens[start:end]
    if num_logits < seq_len:
      window = np.concatenate([np.full(seq_len - len(window), eos_id, np.int32), window])
    logits = np.asarray(forward(params, window[None]))[0]
    logits = logits[-(end - w * stride):]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[w * stride + 1:end + 1])
    total += float(np.sum(nll))
  return total


@pytest.mark.parametrize("name,context,stride", fast_first([
    ("perceiver_ar", 24, 5), ("dense", 20, 6), ("perceiver_ar", 32, 8)], keep=(1,)))
def test_overlapping_windows_equal_a_window_by_window_reference(runs, name, context, stride):
  restored = restore(runs[name], sharded=True, exports=False)
  model, tokenizer, config = restored.model, restored.tokenizer, restored.config
  tokens = np.asarray(runs["corpus"].tokens("test")[:150])
  result = scoring.score_stream(model, tokens, context=context, stride=stride, batch_size=4,
                                 num_bytes=1000, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
  expected = _reference_nll(model, tokens, context=context, stride=stride, seq_len=32,
                            num_logits=scoring.predicted_positions(model, 32),
                            eos_id=tokenizer.eos_id)
  assert result["scored_tokens"] == result["target_tokens"] == 149
  assert result["loss"] * 149 == pytest.approx(expected, rel=1e-5)
  assert result["bits_per_byte"] == pytest.approx(expected / (math.log(2) * 1000), rel=1e-5)


def test_overlapping_windows_score_every_token_once_with_per_position(runs, tmp_path):
  split = "test"
  plain = scoring.evaluate_workdir(runs["dense"], split=split)
  out = str(tmp_path / "pp")
  result = scoring.evaluate_workdir(runs["dense"], split=split, stride=8, per_position=True,
                                     out=out)
  n = runs["corpus"].num_tokens(split)
  assert result["context"] == 32 and result["stride"] == 8
  assert result["scored_tokens"] == result["target_tokens"] == plain["scored_tokens"] == n
  assert abs(result["loss"] - plain["loss"]) > 1e-4  # more context before most targets
  assert math.isfinite(result["bits_per_byte"]) and result["out"] == out
  with open(os.path.join(out, "per_position.json")) as f:
    record = json.load(f)
  losses, counts = record["loss_at_position"], record["count_at_position"]
  assert len(losses) == len(counts) == 32 and sum(counts) == n
  assert all(c > 0 for c in counts) and counts[-1] > counts[0]  # full windows score 24..31
  mean = sum(l * c for l, c in zip(losses, counts)) / sum(counts)
  assert mean == pytest.approx(result["loss"], rel=1e-5)
  with open(os.path.join(out, "per_position.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_text_file_scores_like_the_split_it_came_from(runs, tmp_path):
  corpus = runs["corpus"]
  stream = np.asarray(corpus.tokens("test"))
  end = int(np.flatnonzero(stream == corpus.tokenizer.eos_id)[1])  # the first document's eos
  text = corpus.tokenizer.decode(stream[1:end])
  path = tmp_path / "first_document.txt"
  path.write_text(text, encoding="utf-8")
  tokens, num_bytes = scoring.read_text_file(str(path), corpus.tokenizer)
  np.testing.assert_array_equal(tokens, stream[:end + 1])
  assert num_bytes == len(text.encode("utf-8"))
  result = scoring.evaluate_workdir(runs["dense"], text_file=str(path), stride=16)
  restored = restore(runs["dense"], sharded=True, exports=False)
  model, tokenizer = restored.model, restored.tokenizer
  expected = scoring.score_stream(model, stream[:end + 1], context=32, stride=16, batch_size=4,
                                   num_bytes=num_bytes, eos_id=tokenizer.eos_id,
                                   pad_id=tokenizer.pad_id)
  assert result["text_file"] == str(path) and result["target_tokens"] == end
  assert result["scored_tokens"] == end and result["num_bytes"] == num_bytes
  for key in ("loss", "bits_per_byte"):
    assert result[key] == pytest.approx(expected[key], rel=1e-5)


# Errors: one line, exit status 2.

def _bad_inputs(runs, tmp_path):
  not_a_workdir = tmp_path / "empty"
  not_a_workdir.mkdir()
  untrained = tmp_path / "untrained"
  untrained.mkdir()
  for name in ("config.json", "tokenizer.model"):
    shutil.copy(os.path.join(runs["dense"], name), untrained / name)
  binary = tmp_path / "binary.txt"
  binary.write_bytes(b"ROMEO \xff\xfe\x00 not text")
  dense, pa = runs["dense"], runs["perceiver_ar"]
  return [
      (dict(workdir=str(not_a_workdir)), "has no config.json: it is not a training workdir"),
      (dict(workdir=str(untrained)), "has no checkpoints yet"),
      (dict(workdir=dense, split="nope"), "--split=nope is not a split of shakespeare; use one of "
       "train, validation, test, test_milton"),
      (dict(workdir=dense, text_file=str(tmp_path / "missing.txt")), "cannot be read"),
      (dict(workdir=dense, text_file=str(binary)), "is not UTF-8 text (byte 0xff at offset 6)"),
      (dict(workdir=dense, split="test", text_file=str(binary)), "are both given"),
      (dict(workdir=dense, context=64), "context=64 exceeds model.seq_len=32"),
      (dict(workdir=dense, context=8, stride=16), "stride=16 must be at most context=8"),
      (dict(workdir=dense, stride=-1), "stride=-1 must be a positive integer"),
      (dict(workdir=dense, batch_size=3), "batch_size=3 must be a multiple of the"),
      (dict(workdir=pa, stride=16), "stride=16 exceeds model.num_latents=8"),
      (dict(workdir=dense, stride=8, ablate_context=16, ablate_method="shuffle"),
       "ablate_method='shuffle' is not a known ablation; use swap or eos (--ablate_method)"),
  ]


def test_each_error_is_one_line_and_status_2(runs, tmp_path, capsys):
  for kwargs, message in _bad_inputs(runs, tmp_path):
    assert evaluate.cli(**kwargs) == 2, kwargs
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (kwargs, lines)


@pytest.mark.slow  # the evaluation command in a subprocess
def test_command_line(runs, tmp_path):
  out = tmp_path / "cli"
  command = [sys.executable, "-m", "efficient_lm.evaluate", f"--workdir={runs['dense']}",
             "--split=test", "--stride=16", "--per_position", f"--out={out}"]
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr
  figures = json.loads(done.stdout.strip().splitlines()[-1])
  expected = scoring.evaluate_workdir(runs["dense"], split="test", stride=16)
  assert figures["loss"] == pytest.approx(expected["loss"], rel=1e-6)
  assert figures["scored_tokens"] == runs["corpus"].num_tokens("test")
  assert figures["split"] == "test" and figures["stride"] == 16 and "per_position_loss" not in figures
  assert "dense at step 20 on test: loss" in done.stderr and "bits/byte" in done.stderr
  assert (out / "per_position.json").is_file() and (out / "per_position.png").is_file()
  done = subprocess.run(command[:3] + [f"--workdir={runs['dense']}", "--context=99"], cwd=REPO,
                        capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 2 and done.stdout == ""
  assert [l for l in done.stderr.splitlines() if l.strip()] == [
      "error: context=99 exceeds model.seq_len=32, the window model.name='dense' was trained on "
      "(learned positions, fixed windows and latents cannot go past it); set --context to at most 32"]
