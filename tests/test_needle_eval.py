"""The long-context evaluations (`efficient_lm.evaluation.long_context`): the needle prompts, the rank score
against `.logits`, each family's length rule, the files, and the extrapolation curve against the
library's own scorer."""

import dataclasses
import json
import logging
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, _tiny_sections, build, fast_first, load_config, subprocess_env
from efficient_lm import api
from efficient_lm import data
from efficient_lm import models
from efficient_lm.cli import long_context_command as command
from efficient_lm.evaluation import scoring
from efficient_lm.evaluation.long_context import extrapolate
from efficient_lm.evaluation.long_context import needle
from efficient_lm.evaluation.long_context import needle_grid
from efficient_lm.evaluation.long_context import reach
from efficient_lm.families.dense import DenseConfig
from efficient_lm.training import loop as train
from test_models import CONFIG_OF, FAMILY_FIELDS

# The module's trained fixture is built once: its tests run on one xdist worker (--dist=loadgroup).
pytestmark = pytest.mark.xdist_group("needle_eval_runs")

SEQ_LEN = 32  # conftest's TINY


def _tiny(name, archive, data_dir, **model_overrides):
  config = load_config(name)
  sections = _tiny_sections(archive, data_dir, dict(num_steps=4, eval_every=100, checkpoint_every=4,
                                                    sample_tokens=0))
  for section, fields in sections.items():
    config[section].update(fields)
  config.model.update(model_overrides)
  return config


@pytest.fixture(scope="module")
def window_run(shakespeare_archive, tiny_data_dir, tmp_path_factory):
  """A sliding-window workdir trained 4 steps (window 8 of seq_len 32), loaded."""
  config = _tiny("sliding_window", shakespeare_archive, tiny_data_dir, window=8)
  workdir = str(tmp_path_factory.mktemp("window"))
  train.train_and_evaluate(build(config), workdir)
  lm = api.load(workdir)
  corpus = data.load(data.validate(lm.config.data))
  return lm, needle.haystack_stream(corpus.tokens("test"), lm.eos_id), corpus.tokens("test")


# The prompts.

@pytest.mark.parametrize("variant", needle.VARIANTS)
def test_needles_sit_at_their_depth_in_one_document_and_the_question_asks_their_key(
    window_run, variant):
  lm, haystack, _ = window_run
  length, tok = 400, lm.tokenizer  # the fixture's 384-piece tokenizer spells the needle out
  for depth in (0.0, 0.5, 1.0):
    prompts = needle.build(tok, haystack, length=length, depth=depth, variant=variant,
                           rng=np.random.default_rng(7))
    assert len(prompts) == (needle.EXTRA_NEEDLES + 1 if variant == "multiquery" else 1)
    for p in prompts:
      assert len(p.ids) == length
      # One document: the end-of-document token opens it and none follows (segment ids all equal).
      assert p.ids[0] == lm.eos_id and np.all(p.ids[1:] != lm.eos_id)
      assert len(np.unique(data.document_ids(p.ids[None], lm.eos_id))) == 1
      # Every needle's tokens are where the prompt says; the asked one's at the depth.
      for start, ids in zip(p.needle_starts, p.needle_ids):
        np.testing.assert_array_equal(p.ids[start:start + len(ids)], ids)
      if variant == "multiquery":  # the needles one after another at the depth
        longest = max(len(tok.encode(needle.QUESTION.format(key=q.key))) for q in prompts)
        h = length - 1 - sum(len(i) for i in p.needle_ids) - longest
        order = np.argsort(p.needle_starts)
        assert p.needle_starts[order[0]] == 1 + round(depth * h)
        ends = [p.needle_starts[i] + len(p.needle_ids[i]) for i in order[:-1]]
        assert ends == [p.needle_starts[i] for i in order[1:]]
      else:
        before = sum(len(ids) for s, ids in zip(p.needle_starts[1:], p.needle_ids[1:])
                     if s < p.needle_starts[0])
        assert p.needle_starts[0] == 1 + round(depth * p.haystack) + before
      # The question asks the main needle's key, and its answer is that needle's value.
      main_text = tok.decode(p.needle_ids[0])
      assert main_text == needle.NEEDLE.format(key=p.key, value=p.answers[0])
      question = needle.QUESTION.format(key=p.key)
      assert tok.decode(p.ids[-len(tok.encode(question)):]) == question
      assert tok.decode(p.answer_ids[0]).strip() == p.answers[0]
      # The values in the haystack that are not the answer: every other needle's (multikey,
      # multiquery), none where every needle counts (single has one, multivalue asks them all).
      in_text = [tok.decode(ids).split(" is ")[1].rstrip(".") for ids in p.needle_ids[1:]]
      assert p.other_values == ([] if variant == "multivalue" else in_text)
    if variant == "multikey":  # the distractor needles carry other keys
      others = [tok.decode(ids) for ids in prompts[0].needle_ids[1:]]
      assert all(prompts[0].key not in text for text in others)
    if variant == "multivalue":
      assert len(set(prompts[0].answers)) == needle.EXTRA_NEEDLES + 1


@pytest.mark.parametrize("variant", needle.VARIANTS)
def test_ranked_candidates_put_the_haystacks_other_values_first(window_run, variant):
  """The rank's distractors: the other keys' values in the haystack (what a model that ignores the
  key would answer), then distinct random values; the single needle's draws are unchanged."""
  lm, haystack, _ = window_run
  cells = needle_grid.build_grid(lm.tokenizer, haystack, lengths=[400], depths=[0.5],
                                 needles_per_cell=2, variant=variant, distractors=5)
  for prompt, candidates, ids in cells[(400, 0.5)]:
    k = len(prompt.answers)
    assert candidates[:k] == prompt.answers and len(candidates) == k + 5 == len(ids)
    assert candidates[k:k + len(prompt.other_values)] == prompt.other_values
    assert len(set(candidates)) == len(candidates)
    assert len(prompt.other_values) == {"single": 0, "multivalue": 0}.get(variant, needle.EXTRA_NEEDLES)
    if variant == "single":  # as before other values existed: the same seeded draws
      rng = np.random.default_rng([0, 400, 0, prompt.group])
      again = needle.build(lm.tokenizer, haystack, length=400, depth=0.5, variant=variant, rng=rng)
      assert candidates[1:] == needle.distractor_values(rng, again[0].answers, 5)


def test_keys_come_from_the_given_words(window_run):
  lm, haystack, _ = window_run
  words = ("apple", "river", "garden", "silver", "candle")
  for variant in needle.VARIANTS:
    prompts = needle.build(lm.tokenizer, haystack, length=400, depth=0.5, variant=variant,
                           rng=np.random.default_rng(3), key_words=words)
    for p in prompts:
      assert p.key in words
      for ids in p.needle_ids:
        assert lm.tokenizer.decode(ids).split(" for ")[1].split(" is ")[0] in words
  pairs = needle.build(lm.tokenizer, haystack, length=400, depth=0.5, variant="single",
                       rng=np.random.default_rng(3))
  assert "-" in pairs[0].key


def test_exact_match_reads_the_leading_digits():
  assert needle.is_exact(" 4818263. And", ["4818263"])
  assert not needle.is_exact(" 48182634", ["4818263"])
  assert not needle.is_exact(" the 4818263", ["4818263"])
  assert needle.is_exact("1234567", ["7654321", "1234567"])


def test_leading_digits_counts_the_right_digits_before_the_first_wrong_one():
  assert needle.leading_digits(" 4818263. And", ["4818263"]) == 7
  assert needle.leading_digits(" 48182634", ["4818263"]) == 7  # right digits, not exact
  assert needle.leading_digits(" 481099", ["4818263"]) == 3
  assert needle.leading_digits("5818263", ["4818263"]) == 0
  assert needle.leading_digits(" the 4818263", ["4818263"]) == 0
  assert needle.leading_digits("", ["4818263"]) == 0
  assert needle.leading_digits("76543", ["7654321", "7600000"]) == 5  # the best of the values


def test_digits_in_any_order_counts_the_values_digits_wherever_they_stand():
  assert needle.digits_in_any_order(" 4818263. And", "4818263") == 7
  assert needle.digits_in_any_order(" 3628184", "4818263") == 7  # a permutation of the value
  assert needle.digits_in_any_order(" 88888888", "4818263") == 2  # two 8s in the value, no more
  assert needle.digits_in_any_order("48182639", "4818263") == 7  # digits past the value's length
  assert needle.digits_in_any_order(" 4818200", "4818263") == 5
  assert needle.digits_in_any_order("the 4818263", "4818263") == 0
  assert needle.digits_in_any_order("", "4818263") == 0


def test_chance_levels():
  single = needle_grid.report.chance(1, 9)
  assert single["top1"] == pytest.approx(0.1)
  assert single["mrr"] == pytest.approx(sum(1 / r for r in range(1, 11)) / 10)
  rng = np.random.default_rng(0)  # the best of 4 true among 9 wrong, by simulation
  scores = rng.random((20000, 13))
  ranks = 1 + (scores[:, 4:] >= scores[:, :4].max(1, keepdims=True)).sum(1)
  many = needle_grid.report.chance(4, 9)
  assert many["top1"] == pytest.approx(np.mean(ranks == 1), abs=0.01)
  assert many["mrr"] == pytest.approx(np.mean(1 / ranks), abs=0.01)


def test_wilson_interval():
  w = needle_grid.report.wilson(7, 20)
  assert w["share"] == 0.35 and w["ci_low"] == pytest.approx(0.1812, abs=1e-4)
  assert w["ci_high"] == pytest.approx(0.5671, abs=1e-4)


# The rank score, by hand.

def test_rank_score_equals_a_hand_computation_from_logits(window_run):
  """Each candidate's log-likelihood (the prompt prefilled once, its cache repeated for the
  candidates) equals the one read off the logits of the whole sequence, prompt and answer. The
  prompts (160 tokens: the needle and question alone take about 130 of the fixture's pieces) are
  longer than the model's seq_len, which `.logits` refuses: the logits are the same jitted
  forward pass it runs (`lm.model` on the ids and their document ids)."""
  lm, haystack, _ = window_run
  cells = needle_grid.build_grid(lm.tokenizer, haystack, lengths=[160], depths=[0.5],
                                 needles_per_cell=4, variant="single", distractors=5)
  rows = cells[(160, 0.5)]  # the shapes of the grid test's batches (one compile for both)
  width = max(len(a) for _, _, ids in rows for a in ids)
  prompts = [r[0] for r in rows]
  got = needle.rank_scores(lm.model, prompts, [r[1] for r in rows], [r[2] for r in rows], width,
                           eos_id=lm.eos_id, document_mask=True)
  # Every prompt + candidate as one row, candidates padded to `width` (causal: the padding after
  # an answer never changes its logits), through the model in one pass.
  seqs = np.stack([np.concatenate([p.ids, a, np.full(width - len(a), lm.eos_id, np.int32)])[:-1]
                   for p, _, ids in rows for a in ids])
  logits = np.asarray(lm.model(jnp.asarray(seqs), segment_ids_BT=jnp.asarray(
      data.document_ids(seqs, lm.eos_id))), np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  n = 0
  for b, (prompt, _, ids) in enumerate(rows):
    want = []
    for answer in ids:
      want.append(sum(logp[n, len(prompt.ids) - 1 + i, t] for i, t in enumerate(answer)))
      n += 1
    np.testing.assert_allclose(got[b], want, rtol=0, atol=2e-3)
    assert needle.rank_of(got[b], 1) == 1 + sum(w >= want[0] for w in want[1:])


# Every registered decoder model (`make_mixer`), at its config (`CONFIG_OF`) and its family's
# tiny fields; the sliding window first (the fast tier's). The Perceiver-AR family (its own
# `build`) predicts only its latents: its cache is checked in tests/test_perceiver_decoding.py.
FAMILIES = [(name, *(CONFIG_OF[name] + (None,))[:2], FAMILY_FIELDS[name])
            for name in sorted(models.REGISTRY, key=lambda n: n != "sliding_window")
            if models.REGISTRY[name].make_mixer is not None]


# All slow: the fast tier checks the sliding-window case through the trained model above.
@pytest.mark.parametrize("name,config_file,preset,fields", fast_first(FAMILIES, keep=0))
def test_candidates_read_from_a_repeated_cache_match_a_full_pass(name, config_file, preset, fields):
  """Every family's cache layout (the decoder's [B * H, ...], BCMT's memory, ECP's segments) is
  repeated per candidate right: the candidates' log-likelihoods after a prefilled context equal
  those of the whole sequence in one pass (random weights, contexts past seq_len = 32)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from efficient_lm import models  # pylint: disable=import-outside-toplevel
  config = load_config(config_file, preset)  # honly is bcmt's preset
  config.data.update(seq_len=SEQ_LEN, vocab_size=384)
  config.model.update(d_model=32, num_layers=2, num_heads=2, mlp_ratio=2, **fields)
  model = models.create(build(config).model, rngs=nnx.Rngs(1))
  assert config.model.name == name
  rng = np.random.default_rng(0)
  B, L, R, A = 2, 44, 3, 3
  context_BL = rng.integers(3, 384, size=(B, L)).astype(np.int32)
  context_BL[:, 0] = 2
  context_BL[1, 20] = 2  # a second document in row 1: the candidates belong to it
  answers_BRA = rng.integers(3, 384, size=(B, R, A)).astype(np.int32)
  mask_BRA = np.ones((B, R, A), np.float32)
  mask_BRA[0, 1, 2] = 0  # a shorter candidate
  graphdef, params = nnx.split(model)
  got = np.asarray(needle.candidate_loglik(params, jnp.asarray(context_BL), jnp.asarray(answers_BRA),
                                           jnp.asarray(mask_BRA), graphdef=graphdef,
                                           max_len=L + A, eos_id=2, document_mask=True))
  seqs = np.concatenate([np.repeat(context_BL, R, axis=0), answers_BRA.reshape(B * R, A)],
                        axis=1)[:, :-1]
  logits = np.asarray(model(jnp.asarray(seqs), segment_ids_BT=jnp.asarray(
      data.document_ids(seqs, 2))), np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  for b in range(B):
    for r in range(R):
      n = b * R + r
      want = sum(logp[n, L - 1 + i, answers_BRA[b, r, i]] * mask_BRA[b, r, i] for i in range(A))
      assert got[b, r] == pytest.approx(want, abs=2e-3), (name, b, r)


# Which lengths each family may run.

def test_lengths_past_seq_len_refused_for_learned_positions_and_latents_accepted_with_reach():
  learned = load_config("dense")
  learned.model.position = "learned"
  learned = build(learned)
  with pytest.raises(reach.LengthError, match=r"model.position='learned'.*at most"):
    reach.check(learned, [learned.model.seq_len + 1])
  with pytest.raises(reach.LengthError, match=r"\+10 of answer"):  # the answer needs positions too
    reach.check(learned, [learned.model.seq_len - 5], extra=10)
  perceiver = build(load_config("perceiver_ar"))
  with pytest.raises(reach.LengthError, match="fixed window"):
    reach.check(perceiver, [perceiver.model.seq_len + 1])
  for name in models.REGISTRY:  # every model of bounded reach, at its shipped config
    config = build(load_config(*CONFIG_OF[name]))
    if not models.chunkable(config.model):
      continue
    assert reach.check(config, [config.model.seq_len * 8], extra=10) is None
  dense = build(load_config("dense"))
  assert "out of distribution" in reach.check(dense, [dense.model.seq_len * 2])
  assert reach.check(dense, [dense.model.seq_len]) is None


def test_reach_is_what_the_family_config_declares_not_its_name():
  """A family states its input limit beside its fields (`input_limit`): a dense model whose
  config declares a fixed window is held to it, whatever its name."""

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class FixedWindowDense(DenseConfig):
    def input_limit(self):
      return self.seq_len, "a fixed window of model.seq_len tokens (declared)"

  run = build(load_config("dense"))
  fixed = dataclasses.replace(run, model=FixedWindowDense(**{
      f.name: getattr(run.model, f.name) for f in dataclasses.fields(run.model)}))
  assert reach.check(run, [run.model.seq_len * 2]) is not None  # dense: allowed, with a warning
  with pytest.raises(reach.LengthError, match=r"a fixed window of model.seq_len tokens \(declared\)"):
    reach.check(fixed, [run.model.seq_len + 1])
  assert reach.check(fixed, [run.model.seq_len]) is None
  perceiver = build(load_config("perceiver_ar"))
  assert perceiver.model.input_limit()[0] == perceiver.model.seq_len


# The command: files, one line, bad input.

def test_needle_grid_past_seq_len_writes_json_and_heatmap(window_run, tmp_path, capsys, caplog):
  lm, _, _ = window_run
  out = str(tmp_path / "needle")
  with caplog.at_level(logging.INFO, logger="efficient_lm.evaluation.long_context.needle_grid"):
    status = command.run("needle", workdir=lm.path, lengths=["160", "192"], depths=["0", "1"],
                         needles_per_cell=2, variant="single", distractors=5, batch_size=4,
                         out=out)
  said = [r.getMessage() for r in caplog.records if r.name.endswith("needle_grid")]
  assert [l.split(",")[0] for l in said] == ["needle grid: length 160 done", "needle grid: length 192 done"]
  assert said[-1].endswith("(8 of 8)")
  captured = capsys.readouterr()
  assert status == 0, captured.err
  (line,) = captured.out.strip().splitlines()  # one JSON line, as every command's result
  summary = json.loads(line, parse_constant=pytest.fail)  # strict: no NaN or Infinity
  assert any(l.startswith("needle (single)") and "leading digits right" in l
             for l in captured.err.splitlines())
  record = json.load(open(os.path.join(out, "needle.json")))
  assert summary == {**summary, "task": "needle", "variant": "single", "lengths": [160, 192],
                     "depths": [0.0, 1.0], "exact": record["all"]["exact"],
                     "mrr": record["all"]["mrr"], "chance": record["chance"],
                     "json": os.path.abspath(os.path.join(out, "needle.json"))}
  assert [(c["length"], c["depth"]) for c in record["cells"]] == [(160, 0.0), (160, 1.0),
                                                                   (192, 0.0), (192, 1.0)]
  for cell in record["cells"]:
    assert cell["prompts"] == 2 and cell["exact"]["n"] == 2 and len(cell["answers"]) == 2
    assert 0 <= cell["exact"]["ci_low"] <= cell["exact"]["share"] <= cell["exact"]["ci_high"] <= 1
    ranks = [a["rank"] for a in cell["answers"]]
    assert all(1 <= r <= 6 for r in ranks)
    assert cell["mrr"]["mean"] == pytest.approx(np.mean([1 / r for r in ranks]))
    assert cell["top1"]["count"] == sum(r == 1 for r in ranks)
    assert cell["digits"]["mean"] == pytest.approx(np.mean([a["digits"] for a in cell["answers"]]))
    for a in cell["answers"]:
      assert a["digits"] == needle.leading_digits(a["answer"], [a["expected"]])
      assert a["digits"] == needle.DIGITS or not a["exact"]
    for a in cell["answers"]:  # the needle's place: at its depth, ended before the question
      assert 1 <= a["needle_start"] < a["needle_end"] < cell["length"]
      if cell["depth"] == 0.0:  # right after the end-of-document token
        assert a["needle_start"] == 1
  assert record["chance"]["top1"] == pytest.approx(1 / 6)
  assert os.path.getsize(os.path.join(out, "needle.png")) > 1000


def test_bad_lengths_are_one_error_line(window_run, tmp_path):
  lm, _, _ = window_run
  result = subprocess.run(
      [sys.executable, "-m", "efficient_lm.evaluate", f"--workdir={lm.path}", "--task=needle",
       "--lengths=8"], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
      timeout=300)
  assert result.returncode == 2, result.stderr
  errors = [l for l in result.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and "--lengths: 8 tokens cannot hold" in errors[0], result.stderr
  assert result.stdout == ""


# Extrapolation.

def test_extrapolate_1x_equals_the_scorer_and_runs_past_seq_len(window_run, tmp_path, capsys):
  lm, _, tokens = window_run
  got = extrapolate.curve(lm.model, tokens, length=SEQ_LEN, eos_id=lm.eos_id,
                          pad_id=int(lm.tokenizer.pad_id), batch_size=3, document_mask=True,
                          max_windows=7)
  starts = extrapolate.window_starts(np.asarray(tokens), lm.eos_id, SEQ_LEN)[:7]
  assert np.all(np.diff(starts) == SEQ_LEN)  # the first document's: one stream of 7 windows
  stream = np.asarray(tokens[starts[0]:starts[-1] + SEQ_LEN + 1])
  assert np.all(stream[1:-1] != lm.eos_id)  # inside one document (the last target may end it)
  ref = scoring.score_stream(lm.model, stream, context=SEQ_LEN, stride=SEQ_LEN, batch_size=4,
                             num_bytes=1, eos_id=lm.eos_id, pad_id=int(lm.tokenizer.pad_id),
                             per_position=True, document_mask=True)
  count = np.asarray(ref["per_position_count"], np.float64)
  nll = np.nan_to_num(np.asarray(ref["per_position_loss"], np.float64)) * count
  assert got["tokens"] == int(count.sum()) == 7 * SEQ_LEN
  assert got["loss"] == pytest.approx(nll.sum() / count.sum(), abs=1e-4)
  for b in got["buckets"]:
    assert b["loss"] == pytest.approx(nll[b["low"]:b["high"]].sum() / count[b["low"]:b["high"]].sum(),
                                      abs=1e-4)
    assert b["tokens"] == count[b["low"]:b["high"]].sum()
  assert [(b["low"], b["high"]) for b in got["buckets"]][:3] == [(0, 1), (1, 2), (2, 4)]
  # Past the trained length (the window model's reach is bounded): files and one line.
  out = str(tmp_path / "extrapolate")
  status = command.run("extrapolate", workdir=lm.path, factors=["1", "2"], batch_size=4, out=out,
                       max_tokens=256)
  assert status == 0, capsys.readouterr().err
  record = json.load(open(os.path.join(out, "extrapolate.json")))
  assert [c["length"] for c in record["curves"]] == [SEQ_LEN, 2 * SEQ_LEN]
  assert record["curves"][1]["buckets"][-1] == {**record["curves"][1]["buckets"][-1],
                                                "low": SEQ_LEN, "high": 2 * SEQ_LEN}
  assert os.path.getsize(os.path.join(out, "extrapolate.png")) > 1000
  captured = capsys.readouterr()
  (line,) = captured.out.strip().splitlines()
  summary = json.loads(line, parse_constant=pytest.fail)
  assert summary["task"] == "extrapolate" and summary["factors"] == [1, 2]
  assert [(c["factor"], c["loss"]) for c in summary["curves"]] == [
      (c["factor"], c["loss"]) for c in record["curves"]]
  assert summary["png"] == os.path.abspath(os.path.join(out, "extrapolate.png"))
  assert any(l.startswith("extrapolate sliding_window") for l in captured.err.splitlines())


def test_the_docs_commands_use_the_evaluators_flags():
  """Every `python -m efficient_lm.evaluate` command of docs/long_context_evals.md names only flags
  the command defines (efficient_lm/cli/evaluate_command.py), and the task values it has."""
  import re  # pylint: disable=import-outside-toplevel
  with open(os.path.join(REPO, "docs", "long_context_evals.md"), encoding="utf-8") as f:
    doc = f.read()
  with open(os.path.join(REPO, "efficient_lm", "cli", "evaluate_command.py"), encoding="utf-8") as f:
    defined = set(re.findall(r'flags\.DEFINE_\w+\(\s*"(\w+)"', f.read()))
  commands = [c.replace("\\\n", " ") for c in re.findall(r"```\n(python -m efficient_lm\.evaluate[^`]*)```",
                                                          doc)]
  assert len(commands) == 4
  for command_line in commands:
    names = re.findall(r"--(\w+)", command_line)
    assert names and set(names) <= defined, (set(names) - defined, command_line)
    assert re.search(r"--task=(needle|extrapolate|ruler)\b", command_line)
