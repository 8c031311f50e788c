"""`data.dataset='needle:<options>'`: needles planted in the fixture corpus's text, the questions at
the end, the answer-only loss, held-out sequences from held-out text, a run through main."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, subprocess_env
from efficient_lm import data
from efficient_lm.config import base as config_base
from efficient_lm.config.data import DataConfig
from efficient_lm.config.errors import ConfigError
from efficient_lm.data import needle

SEQ_LEN = 384  # no model here: room for two asked needles, a distractor and a haystack


def _data_config(shakespeare_archive, tiny_data_dir, dataset, seq_len=SEQ_LEN, **fields):
  """The typed data section (`data.validate` of a config's data section)."""
  archive, sha = shakespeare_archive
  cfg = config_base.base_config('dense').data
  cfg.update(dict(dataset=dataset, seq_len=seq_len, batch_size=4, vocab_size=384,
                  data_dir=tiny_data_dir, archive=archive, archive_sha256=sha, **fields))
  return data.validate(DataConfig.from_mapping(cfg))


@pytest.fixture(scope='module')
def corpus(shakespeare_archive, tiny_data_dir):
  """Two asked needles and a distractor in windows of the fixture corpus (its trained tokenizer)."""
  return data.load(_data_config(shakespeare_archive, tiny_data_dir,
                                'needle:needles=2,distractors=1,eval_sequences=24,seed=3'))


@pytest.fixture(scope='module')
def base(shakespeare_archive, tiny_data_dir):
  return data.load(_data_config(shakespeare_archive, tiny_data_dir, 'shakespeare'))


def _haystack_text(corpus, s) -> list[str]:
  """The text of the haystack pieces of a sequence (between the needles, before the questions)."""
  tok = corpus.tokenizer
  lengths = [len(corpus._texts.needle(k, v)) for k, v in zip(s.keys, s.values)]
  asked = sum(len(corpus._texts.question(k, v)[0]) for k, v in
              zip(s.keys[:corpus.task.needles], s.values[:corpus.task.needles]))
  cuts, done = [], 1
  for i in np.argsort(s.starts):
    cuts.append(tok.decode(s.x[done:s.starts[i]]))
    done = s.starts[i] + lengths[i]
  cuts.append(tok.decode(s.x[done:len(s.x) - 1 - asked]))
  return cuts


# ----------------------------------------------------------------------------------------------
# Options.


@pytest.mark.parametrize('dataset,expected', [
    ('needle:needle=2', "unknown needle option 'needle'; did you mean needles"),
    ('needle:base=mqar:', 'needle:base=\'mqar:\' has no text (a generated task); name a text dataset'),
    ('needle:base=shakespear', "needle:base='shakespear' is not a text dataset; name one of"),
    ('needle:needles=0', "needle:needles=0 must be at least 1; set needles>=1"),
    ('needle:needles=x', "needle:needles='x' must be an integer"),
    ('needle:keys=3,needles=2,distractors=2', 'needle:keys=3 is below needles+distractors=4'),
    ('needle:keys=65', 'needle:keys=65 exceeds the 64 key words; set keys<=64'),
    ('needle:loss=digits', "needle:loss='digits' is not a loss; write loss=answer"),
    ('needle:seed=1,seed=2', "needle:seed='2' is given twice"),
    ('needle:loss=', "needle:loss='' has no value"),
])
def test_bad_options(dataset, expected):
  with pytest.raises(ConfigError) as e:
    needle.parse(dataset)
  assert expected in str(e.value)
  assert '\n' not in str(e.value) and '; ' in str(e.value)  # one line, with its fix


def test_defaults_and_canonical_spec():
  task = needle.parse('needle:')
  assert (task.base, task.needles, task.distractors, task.keys, task.loss) == (
      'shakespeare', 1, 0, len(needle.KEY_WORDS), 'answer')
  assert needle.parse(task.spec) == task
  assert data.known_splits(DataConfig(dataset='needle:base=wikitext103')) == (
      'train', 'validation', 'test')


def test_seq_len_too_short_is_one_line_naming_the_field(base, shakespeare_archive, tiny_data_dir):
  with pytest.raises(ConfigError, match=r'^data.seq_len=64 cannot hold .*; raise data.seq_len'):
    needle.check_fits(needle.parse('needle:needles=1'), base.tokenizer, 64)
  # With a data.tokenizer, known before anything compiles: preflight says so.
  given = _data_config(shakespeare_archive, tiny_data_dir, 'needle:needles=1', seq_len=64,
                       tokenizer=base.tokenizer.model_path)
  with pytest.raises(ConfigError, match=r'^data.seq_len=64 cannot hold'):
    data.preflight(given)
  given = dataclasses.replace(given, seq_len=256)
  assert data.preflight(given).task == needle.parse('needle:needles=1')
  given = dataclasses.replace(given, seq_len=2048)  # longer than the fixture's validation text
  with pytest.raises(data.DataError, match=r'^the validation split of shakespeare has 995 tokens, '
                     'fewer than data.seq_len=2048'):
    data.load(given)


# ----------------------------------------------------------------------------------------------
# Sequences.


def test_needles_at_their_depths_and_questions_at_the_end(corpus):
  tok, task = corpus.tokenizer, corpus.task
  needle_format, question_format = needle.NEEDLE, needle.QUESTION  # the evaluator's too
  assert question_format.format(key='k').startswith('What is the special magic number for k?')
  for i in range(8):
    s = corpus.sequence('validation', i)
    assert len(s.x) == SEQ_LEN + 1 and s.x[0] == s.x[-1] == tok.eos_id
    assert not (s.x[1:-1] == tok.eos_id).any()  # one document: no end-of-document inside
    assert len(set(s.keys)) == 3 and all(k in needle.KEY_WORDS for k in s.keys)
    assert all(len(v) == 7 and v.isdigit() and v[0] != '0' for v in s.values)
    lengths = [len(corpus._texts.needle(k, v)) for k, v in zip(s.keys, s.values)]
    asked = sum(len(corpus._texts.question(k, v)[0]) for k, v in zip(s.keys[:2], s.values[:2]))
    H = SEQ_LEN - 1 - asked - sum(lengths)
    for j, (key, value, depth, start) in enumerate(zip(s.keys, s.values, s.depths, s.starts)):
      planted = tok.decode(s.x[start:start + lengths[j]])
      assert planted == ' ' + needle_format.format(key=key, value=value)
      before = sum(lengths[m] for m in range(3) if s.starts[m] < start)  # needles earlier on
      assert start - 1 - before == math.floor(depth * (H + 1))  # haystack tokens before it
    text = tok.decode(s.x)
    tail = ''.join(f' {question_format.format(key=k)} {v}.'
                   for k, v in zip(s.keys[:task.needles], s.values[:task.needles]))
    assert text.endswith(tail)
    assert question_format.format(key=s.keys[2]) not in text  # the distractor is not asked
    for answer, value in zip(s.answers, s.values):  # the scored targets spell the value
      assert tok.decode(s.x[1:][list(answer)]).strip() == value


def test_depths_are_uniform(corpus):
  depths = np.array([d for i in range(150) for d in corpus.sequence('train', i, seed=1).depths])
  counts, _ = np.histogram(depths, bins=4, range=(0, 1))
  assert counts.min() > 0.6 * len(depths) / 4, counts  # each quarter near its share (450 draws)


def test_held_out_sequences_hold_held_out_text_only(corpus, base):
  tok = base.tokenizer
  train_text = tok.decode(base.tokens('train'))
  validation_text = tok.decode(base.tokens('validation'))
  pieces = [p for i in range(corpus.task.eval_sequences)
            for p in _haystack_text(corpus, corpus.sequence('validation', i))]
  assert sum(len(p) for p in pieces) > 2000
  for piece in pieces:  # each haystack piece is validation text (an eos read as a newline)
    assert all(part in validation_text for part in piece.split('\n') if part)
  seen = '\x00'.join(pieces)
  for start in range(0, len(train_text) - 300, 150):  # no 300 characters of train text in them
    assert train_text[start:start + 300] not in seen
  train_pieces = [p for i in range(4) for p in _haystack_text(corpus, corpus.sequence('train', i))]
  assert all(part in train_text for piece in train_pieces for part in piece.split('\n') if part)


def test_answer_only_loss_and_bytes(corpus, shakespeare_archive, tiny_data_dir):
  task = corpus.task
  s = corpus.sequence('validation', 0)
  scored = np.flatnonzero(s.weights)
  assert sorted(scored.tolist()) == sorted(p for a in s.answers for p in a)
  assert len(scored) >= 2 * 7  # every digit of both answers
  batch = next(corpus.eval_batches('validation', batch_size=4))
  assert set(batch) == {'inputs', 'targets', 'weights', 'segment_ids'}
  np.testing.assert_array_equal(batch['weights'][0], s.weights)
  np.testing.assert_array_equal(batch['inputs'][0], s.x[:-1])
  # Bits per byte counts the bytes of the scored text: the answers' digits (2 x 7 per sequence).
  assert 2 * 7 * task.eval_sequences <= corpus.num_bytes('validation') <= 2 * 8 * task.eval_sequences
  everything = data.load(_data_config(shakespeare_archive, tiny_data_dir, task.spec.replace(
      'loss=answer', 'loss=all')))
  s_all = everything.sequence('validation', 0)
  np.testing.assert_array_equal(s_all.x, s.x)  # the loss changes the weights only
  assert s_all.weights.min() == 1
  text_bytes = sum(len(everything.tokenizer.decode(q.x).encode()) for q in everything.held_out('validation'))
  assert everything.num_bytes('validation') == text_bytes
  # answer_end: the digits and the target after each answer's last digit, whose token ends the
  # value (no digit in it), so that greedy decoding can learn to stop.
  ended = data.load(_data_config(shakespeare_archive, tiny_data_dir, task.spec.replace(
      'loss=answer', 'loss=answer_end'))).sequence('validation', 0)
  np.testing.assert_array_equal(ended.x, s.x)
  ends = [a[-1] + 1 for a in s.answers]
  assert sorted(np.flatnonzero(ended.weights).tolist()) == sorted(scored.tolist() + ends)
  for end, answer, value in zip(ends, s.answers, s.values):
    assert corpus.tokenizer.decode(s.x[answer[0] + 1:answer[-1] + 2]).strip() == value
    assert not any(c.isdigit() for c in corpus.tokenizer.decode(s.x[end + 1:end + 2]))


def test_deterministic_resumable_and_seeded(corpus, shakespeare_archive, tiny_data_dir):
  again = data.load(_data_config(shakespeare_archive, tiny_data_dir, corpus.task.spec))
  np.testing.assert_array_equal(again.sequence('validation', 5).x, corpus.sequence('validation', 5).x)
  stream = corpus.tokens('validation')
  np.testing.assert_array_equal(stream[5 * SEQ_LEN:6 * SEQ_LEN + 1], corpus.sequence('validation', 5).x)
  it = corpus.train_iterator(batch_size=2, seed=7)
  first = [next(it)['inputs'] for _ in range(3)]
  state = it.get_state()
  fourth = next(it)['inputs']
  resumed = corpus.train_iterator(batch_size=2, seed=7)
  resumed.set_state(json.loads(json.dumps(state)))
  np.testing.assert_array_equal(next(resumed)['inputs'], fourth)
  other = next(corpus.train_iterator(batch_size=2, seed=8))['inputs']
  assert not np.array_equal(other, first[0])


def test_min_length_packs_examples_each_its_own_document(shakespeare_archive, tiny_data_dir):
  """`min_length=L`: a sequence holds examples of L tokens and more, each a document (its needle
  and its question on the same side of every end-of-document), the answers scored where they are;
  the spec names min_length only when set, so specs recorded before it stay the same."""
  assert 'min_length' not in needle.parse('needle:').spec
  spec = 'needle:needles=1,distractors=1,min_length=240,eval_sequences=8'
  task = needle.parse(spec)
  assert task.min_length == 240 and needle.parse(task.spec) == task
  packed = data.load(_data_config(shakespeare_archive, tiny_data_dir, spec, seq_len=960))
  tok = packed.tokenizer
  needle_format, question_format = needle.NEEDLE, needle.QUESTION
  examples = 0
  for i in range(6):
    s = packed.sequence('train', i, seed=2)
    assert len(s.x) == 961 and s.x[0] == s.x[-1] == tok.eos_id
    ends = np.flatnonzero(s.x == tok.eos_id)
    assert np.diff(ends).min() >= 240  # every example spans at least min_length targets
    examples += len(ends) - 1
    assert len(s.keys) == 2 * (len(ends) - 1) and len(s.answers) == len(ends) - 1
    doc = np.searchsorted(ends, np.arange(len(s.x)), side='right')  # document of each position
    for j, answer in enumerate(s.answers):
      key, value, start = s.keys[2 * j], s.values[2 * j], s.starts[2 * j]
      text = tok.decode(s.x[start:start + len(packed._texts.needle(key, value))])
      assert text == ' ' + needle_format.format(key=key, value=value)
      assert tok.decode(s.x[1:][list(answer)]).strip() == value
      assert doc[start] == doc[answer[0] + 1]  # the needle in its question's document
      question = tok.decode(s.x[answer[0] + 1 - 40:answer[0] + 1])
      assert question_format.format(key=key)[-30:] in question
    np.testing.assert_array_equal(np.flatnonzero(s.weights), sorted(p for a in s.answers for p in a))
  assert examples > 6  # several examples a sequence (a uniform draw of 240..960, then the rest)
  assert needle.spans(task, np.random.default_rng(0), 100) == [100]  # L >= seq_len: one example
  with pytest.raises(ConfigError, match=r'^needle:min_length=40 cannot hold an example of .*; '
                     'raise min_length to at least'):
    needle.check_fits(needle.parse('needle:min_length=40'), tok, 960)


# ----------------------------------------------------------------------------------------------
# The command line.


def _main(args):
  return subprocess.run([sys.executable, '-m', 'efficient_lm.main', *args], capture_output=True,
                        text=True, cwd=REPO, timeout=600, env=subprocess_env())


def test_main_trains_on_needles(tmp_path, tiny_cli_args):
  """A few steps of a tiny model on needle sequences of the fixture corpus, with an evaluation:
  the workdir records the task; a bad option stops with one line, before anything compiles."""
  workdir = tmp_path / 'w'
  spec = 'needle:needles=1,eval_sequences=8'
  args = tiny_cli_args(str(workdir), num_steps=4, eval_every=4, checkpoint_every=4, log_every=2,
                       sample_prompt='') + [f'--config.data.dataset={spec}',
                                            '--config.data.seq_len=128', '--config.model.num_layers=1']
  done = _main(args)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'NeedleCorpus(needle:base=shakespeare,needles=1' in done.stderr
  metrics = [json.loads(line) for line in open(workdir / 'metrics.jsonl')]
  final = [m for m in metrics if 'eval_loss' in m][-1]
  assert final['step'] == 4 and math.isfinite(final['eval_loss']) and final['eval_bits_per_byte'] > 0
  assert json.load(open(workdir / 'data.json'))['dataset'] == needle.parse(spec).spec
  assert os.path.isfile(workdir / 'tokenizer.model')
  # The evaluator on this workdir asks the keys it learned on, over its base corpus's held-out text
  # (the needle split's own sequences would bring their own needles into the haystack).
  from efficient_lm.cli import long_context_command as command  # pylint: disable=import-outside-toplevel
  out = str(tmp_path / 'grid')
  status = command.run('needle', workdir=str(workdir), lengths=['128'], depths=['0.5'],
                       needles_per_cell=3, distractors=3, batch_size=3, out=out)
  assert status == 0
  record = json.load(open(os.path.join(out, 'needle.json')))
  assert record['keys'] == 'words' and record['haystack'] == 'test split of shakespeare'
  bad = _main(tiny_cli_args(str(tmp_path / 'bad')) + ['--config.data.dataset=needle:needles=0'])
  assert bad.returncode == 2
  errors = [line for line in bad.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and 'needle:needles=0 must be at least 1' in errors[0], bad.stderr[-2000:]
  assert 'compiling' not in bad.stderr
