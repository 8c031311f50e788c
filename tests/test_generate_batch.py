"""Batched, ragged generation (`generation.generate_batch`) and the sample command's batch flags.

A random-init model with an untied head (a tied one mostly repeats its input token) gives varied
greedy continuations, so a row that read another row's tokens, or its own at the wrong position,
would decode differently.
"""

import json
import subprocess
import sys
import types

import numpy as np
import pytest
from flax import nnx

from conftest import REPO, build, fast_first, subprocess_env
from efficient_lm import models
from efficient_lm.cli import sample_command as sample
from efficient_lm.inference import generation
from efficient_lm.training import loop as train
from test_models import tiny_model_config

# Every registered model (tiny sizes, test_models.FAMILY_FIELDS), and BCMT with learned positions.
FAMILIES = [(name, {}) for name in sorted(models.REGISTRY)] + [
    ("bcmt", dict(position="learned", seq_len=64))]
IDS = [name + ("-learned" if fields else "") for name, fields in FAMILIES]
# Contexts of 3, 10 and 41 tokens: across BCMT's blocks of 8 and ECP's segments, past π's and the
# sliding window's reach, and longer than Perceiver-AR's window of 32 (cut to its last 32).
PROMPTS = [[5, 9], [7, 3, 8, 30, 12, 6, 44, 21, 9], list(np.arange(40) * 7 % 61 + 2)]


def tiny_model(name, seed=0, **fields):
  cfg = tiny_model_config(name, tie_embeddings=False, **fields)
  return models.create(cfg, rngs=nnx.Rngs(seed))


def greedy(model, prompts, **kw):
  return generation.generate_batch(model, prompts, num_tokens=12, eos_id=1, temperature=0.0,
                                   stop_ids=(), **kw)


@pytest.mark.parametrize("name,fields", fast_first(FAMILIES, keep=(IDS.index("pi_attention"),)),
                         ids=IDS)
def test_greedy_batch_equals_one_prompt_at_a_time(name, fields):
  model = tiny_model(name, **fields)
  batch = greedy(model, PROMPTS, steps_per_call=16)  # 50 decoding steps: four calls
  for prompt, row in zip(PROMPTS, batch):
    np.testing.assert_array_equal(row, generation.generate(model, prompt, num_tokens=12, eos_id=1,
                                                           temperature=0.0))
  assert len({tuple(row) for row in batch}) == 3  # the rows really differ
  # Another prompt in row 0 (same length: the same programs) leaves rows 1 and 2 as they were.
  other = greedy(model, [[11, 40]] + PROMPTS[1:], steps_per_call=16)
  assert not np.array_equal(other[0], batch[0])
  for a, b in zip(other[1:], batch[1:]):
    np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def pi_model():
  return tiny_model("pi_attention", seed=1)


def test_greedy_picks_what_argmax_picks_ties_and_nans_included():
  """`generation.greedy` (two levels of plain reductions) against numpy's argmax: the first maximum, the
  first NaN, a row of -inf (a masked vocabulary), random rows."""
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((6, 300)).astype(np.float32)
  logits[1, [7, 40, 299]] = 9.0                  # a tie: the first index wins
  logits[2, [3, 50]] = np.nan                    # NaN: the first NaN, as argmax
  logits[3] = -np.inf
  logits[4, 299] = np.inf
  got = np.asarray(generation.greedy(logits))
  np.testing.assert_array_equal(got, [np.argmax(row) for row in logits])
  assert list(got[1:5]) == [7, 3, 0, 299] and got.dtype == np.int32
  # Several blocks of GREEDY_BLOCK entries: ties and NaNs across blocks, a maximum in the padding's
  # last (partial) block, a whole block of -inf before the maximum.
  G = generation.GREEDY_BLOCK
  logits = rng.standard_normal((6, 3 * G + 5)).astype(np.float32)
  logits[0, [G + 9, 2 * G + 1, 3 * G + 4]] = 9.0
  logits[1, [2 * G + 3, G + 100]] = np.nan
  logits[2, 3 * G + 4] = 50.0
  logits[3, :G] = -np.inf
  logits[4, :] = -np.inf
  logits[5, [G - 1, G]] = 7.0
  got = np.asarray(generation.greedy(logits))
  np.testing.assert_array_equal(got, [np.argmax(row) for row in logits])
  assert list(got[[0, 1, 2, 4, 5]]) == [G + 9, G + 100, 3 * G + 4, 0, G - 1] and got[3] >= G


def test_sampled_rows_do_not_depend_on_the_other_rows(pi_model):
  sample = lambda prompts, seed=3: generation.generate_batch(
      pi_model, prompts, num_tokens=16, eos_id=1, temperature=1.0, top_k=0, seed=seed, stop_ids=())
  first = sample([[5, 9, 11], [6, 6, 6]])  # one shape throughout: compiled once
  np.testing.assert_array_equal(sample([[20, 21, 22], [6, 6, 6]])[1], first[1])
  # Row 0 of a batch draws as the prompt alone does (its key stream is (seed, row 0)).
  np.testing.assert_array_equal(generation.generate(pi_model, [5, 9, 11], num_tokens=16, eos_id=1,
                                                    temperature=1.0, top_k=0, seed=3), first[0])
  assert not np.array_equal(sample([[5, 9, 11], [6, 6, 6]], seed=4)[0], first[0])
  same = sample([[5, 9, 11], [5, 9, 11]])  # the same prompt twice: two different samples
  assert not np.array_equal(same[0], same[1])


def test_rows_stop_at_their_first_stop_id_which_is_kept(pi_model):
  prompts = [[5, 9, 11], [6, 6], [30, 31, 32, 33, 34, 35]]
  full = greedy(pi_model, prompts, steps_per_call=4)
  stop = int(full[0][3])
  stopped = greedy(pi_model, prompts, steps_per_call=4)  # stop_ids=() never stops
  assert [len(row) for row in stopped] == [12, 12, 12]
  stopped = generation.generate_batch(pi_model, prompts, num_tokens=12, eos_id=1,
                                      temperature=0.0, stop_ids=[stop], steps_per_call=4)
  for row, out in zip(full, stopped):
    hits = np.flatnonzero(row == stop)
    np.testing.assert_array_equal(out, row[:hits[0] + 1] if len(hits) else row)
  assert len(stopped[0]) <= 4
  # `until` (the text-level stop strings) ends a row on the host between calls.
  cut = generation.generate_batch(pi_model, prompts, num_tokens=12, eos_id=1, temperature=0.0,
                                  stop_ids=(), steps_per_call=4,
                                  until=lambda row, ids: row == 2 and len(ids) >= 2)
  assert len(cut[2]) < 12 and len(cut[2]) >= 2
  np.testing.assert_array_equal(cut[2], full[2][:len(cut[2])])
  assert [len(row) for row in cut[:2]] == [12, 12]


def test_until_returns_the_ids_up_to_where_it_first_held(pi_model):
  """The issue's case (two rows, `until` true for row 0 after 2 ids, num_tokens 8, one step a
  call): row 0 comes back with its first 2 ids, row 1 whole; and with several steps a call, rows
  stopping at different steps inside a call while others run, and a stop id before `until`."""
  prompts = [[5, 9, 11], [6, 6]]
  full = generation.generate_batch(pi_model, prompts, num_tokens=8, eos_id=1, temperature=0.0,
                                   stop_ids=(), steps_per_call=1)
  asked = []

  def until(row, ids):
    asked.append((row, len(ids)))
    return row == 0 and len(ids) >= 2

  cut = generation.generate_batch(pi_model, prompts, num_tokens=8, eos_id=1, temperature=0.0,
                                  stop_ids=(), steps_per_call=1, until=until)
  assert [len(r) for r in cut] == [2, 8]
  np.testing.assert_array_equal(cut[0], full[0][:2])
  np.testing.assert_array_equal(cut[1], full[1])
  assert max(n for row, n in asked if row == 0) == 2  # row 0 is not asked again once stopped
  # Several steps a call: rows 0, 1, 2 stop after 3, 6 and 1 ids (inside the calls of 4 steps),
  # row 3 runs to its count; the stops land on their own ids, whatever the call boundaries.
  prompts = [[5, 9, 11], [6, 6], [30, 31, 32, 33, 34, 35], [7, 8]]
  full = generation.generate_batch(pi_model, prompts, num_tokens=12, eos_id=1, temperature=0.0,
                                   stop_ids=(), steps_per_call=4)
  want = {0: 3, 1: 6, 2: 1}
  for steps in (1, 4, 5, 64):
    cut = generation.generate_batch(
        pi_model, prompts, num_tokens=12, eos_id=1, temperature=0.0, stop_ids=(),
        steps_per_call=steps, until=lambda row, ids: len(ids) >= want.get(row, 99))
    assert [len(r) for r in cut] == [3, 6, 1, 12], steps
    for row, out in zip(full, cut):
      np.testing.assert_array_equal(out, row[:len(out)])
  # A stop id that comes first ends the row there (kept); `until` ends it only if it held before.
  stop = int(full[1][2])
  first = np.flatnonzero(full[1] == stop)[0]
  cut = generation.generate_batch(pi_model, prompts, num_tokens=12, eos_id=1, temperature=0.0,
                                  stop_ids=[stop], steps_per_call=4,
                                  until=lambda row, ids: row == 1 and len(ids) >= first + 2)
  np.testing.assert_array_equal(cut[1], full[1][:first + 1])


class CharTokenizer:
  """A test double of the tokenizer interface: one id per character of a small alphabet."""
  ALPHABET = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:!?'-0"  # ids 2..63
  eos_id, vocab_size = 1, 64

  def encode(self, text):
    return np.asarray([self.ALPHABET.index(c) + 2 for c in text], np.int32)

  def decode(self, ids):
    return "".join(self.ALPHABET[int(i) - 2] for i in ids if int(i) >= 2)


def test_text_stops_before_a_stop_string(pi_model):
  tok = CharTokenizer()
  prompts = ["the lord", "of"]
  plain = generation.generate_texts(pi_model, tok, prompts, num_tokens=12, document_mask=True,
                                    temperature=0.0)
  continuation = plain[0].text[len("the lord"):]
  assert plain[0].text.startswith("the lord") and len(continuation) >= 6
  stop = continuation[4:6]
  cut = generation.generate_texts(pi_model, tok, prompts, num_tokens=12, document_mask=True,
                                  temperature=0.0, stop=[stop], steps_per_call=3)
  at = continuation.find(stop)
  assert cut[0].text == "the lord" + continuation[:at]
  assert tok.decode(cut[0].tokens) == continuation[:at + len(stop)]  # up to the stop's last token
  for r in cut:
    assert stop not in r.text[len(r.prompt):]


def test_bad_prompts_are_refused_before_anything_compiles():
  model = tiny_model("dense", position="learned", seq_len=16)
  with pytest.raises(ValueError, match="after a prompt of 10 do not fit the model's learned"):
    generation.generate_batch(model, [[5], list(range(3, 13))], num_tokens=6, eos_id=1)
  with pytest.raises(ValueError, match="non-empty list"):
    generation.generate_batch(model, [], num_tokens=6, eos_id=1)
  with pytest.raises(ValueError, match=r"prompts_ids\[1\] holds ids outside 0..63"):
    generation.generate_batch(model, [[5], [64]], num_tokens=2, eos_id=1)
  with pytest.raises(ValueError, match="generate takes one 1-D prompt"):
    generation.generate(model, np.ones((2, 3), np.int32), num_tokens=2, eos_id=1)


# The command line.

def run_cli(*args):
  return subprocess.run([sys.executable, "-m", "efficient_lm.sample", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=600, env=subprocess_env())


@pytest.mark.slow  # trains a workdir, then four sampling processes
def test_cli_batch_equals_each_prompt_alone(tiny_config, tmp_path):
  config = tiny_config("pi_attention", num_steps=10, sample_tokens=0)
  config.model.update(window=8, period=8, num_skips=2)
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(build(config), workdir)
  prompts = ["thou art", "good night sweet prince", "what light"]
  common = [f"--workdir={workdir}", "--max_new_tokens=24", "--temperature=0"]
  batch = run_cli(*common, *[f"--prompt={p}" for p in prompts], "--json")
  assert batch.returncode == 0, batch.stderr
  lines = [json.loads(line) for line in batch.stdout.splitlines()]
  assert [line["prompt"] for line in lines] == prompts
  for prompt, line in zip(prompts, lines):
    alone = run_cli(*common, f"--prompt={prompt}")
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout == line["text"] + "\n"
    assert line["text"].startswith(prompt) and 1 <= len(line["tokens"]) <= 24
  # The same prompts from a file (one a line, escapes read), with a stop string.
  path = tmp_path / "prompts.txt"
  path.write_text("\n".join(prompts) + "\n\n", encoding="utf-8")
  stop = lines[0]["text"][len(prompts[0]) + 2:len(prompts[0]) + 4]
  cut = run_cli(*common, f"--prompts_file={path}", f"--stop={stop}", "--json")
  assert cut.returncode == 0, cut.stderr
  cut_lines = [json.loads(line) for line in cut.stdout.splitlines()]
  assert len(cut_lines) == 3
  assert cut_lines[0]["text"] == lines[0]["text"][:lines[0]["text"].index(stop, len(prompts[0]))]
  empty = run_cli(*common, "--prompt=a", "--stop=")
  assert empty.returncode == 2 and "--stop" in empty.stderr and empty.stdout == ""


def test_cli_refuses_a_prompts_file_it_cannot_read(tmp_path):
  missing = run_cli(f"--workdir={tmp_path}", f"--prompts_file={tmp_path}/none.txt")
  assert missing.returncode == 2 and "--prompts_file" in missing.stderr
  assert missing.stdout == "" and len(missing.stderr.strip().splitlines()) == 1


def test_prompts_come_from_the_flags_then_the_file_unescaped(tmp_path):
  path = tmp_path / "prompts.txt"
  path.write_text("one\\ttwo\n\n  \nthree\n", encoding="utf-8")
  flags = lambda **kw: types.SimpleNamespace(**dict(dict(prompt=None, prompts_file=None,
                                                         escapes=True), **kw))
  assert sample._prompts(flags(prompt=["a\\nb"], prompts_file=str(path))) == [
      "a\nb", "one\ttwo", "three"]
  assert sample._prompts(flags(prompts_file=str(path), escapes=False))[0] == "one\\ttwo"
  assert sample._prompts(flags()) == [""]
  path.write_text("\n\n", encoding="utf-8")
  with pytest.raises(ValueError, match="holds no prompt"):
    sample._prompts(flags(prompts_file=str(path)))
