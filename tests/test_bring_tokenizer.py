"""`data.tokenizer`: a sentencepiece model or a Hugging Face tokenizer.json of one's own, used as
it is; the token cache keyed by the tokenizer's identity; the workdir's byte-identical copy.

The tokenizers are trained here, on the fixture text: a sentencepiece model shaped as published
ones are (unk 0, bos 1, eos 2, no pad, byte fallback, identity normalization as Llama's) and a
byte-level BPE with `<|endoftext|>`; both give the text back, so both get bits per byte
(tests/test_meaningful_data.py: the tokenizers that do not).
"""

import json
import os
import re
import subprocess
import sys

import ml_collections
import numpy as np
import jax
import pytest

from conftest import REPO, SHAKESPEARE_WORKS, build, fake_work_text, load_config, subprocess_env
from efficient_lm.training import prepare as config_check
from efficient_lm.config.data import DataConfig
from efficient_lm import data
from efficient_lm.config.errors import ConfigError
from efficient_lm.data import archives
from efficient_lm.data import cache
from efficient_lm.data import config as data_config_lib
from efficient_lm.data.tokenizer import Tokenizer, open_tokenizer
from efficient_lm.evaluation import scoring
from efficient_lm.state import workdir as workdir_lib

TEXT_LINES = ''.join(fake_work_text(w) for w in SHAKESPEARE_WORKS).splitlines()
SAMPLE = 'Thou art\tÆsop’s “fable” é ▁ <|endoftext|> </s> [SEP]\n  sweet prince\n'


def _train_sentencepiece(prefix: str, **overrides) -> str:
  import sentencepiece as spm  # pylint: disable=import-outside-toplevel
  settings = dict(vocab_size=320, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
                  normalization_rule_name='identity', remove_extra_whitespaces=False,
                  hard_vocab_limit=False, minloglevel=2)  # (as Llama's: it gives the text back)
  settings.update(overrides)
  spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT_LINES), model_prefix=prefix, **settings)
  return prefix + '.model'


def _train_byte_level_bpe(path: str, special_tokens=('<|endoftext|>',)) -> str:
  from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  tok = HF(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(TEXT_LINES, trainers.BpeTrainer(
      vocab_size=420, special_tokens=list(special_tokens), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(path)
  return path


@pytest.fixture(scope='module')
def own(tmp_path_factory):
  """{'sp': a published-shape sentencepiece .model, 'hf': a byte-level BPE tokenizer.json}."""
  folder = tmp_path_factory.mktemp('own_tokenizers')
  return {'sp': _train_sentencepiece(str(folder / 'published')),
          'hf': _train_byte_level_bpe(str(folder / 'tokenizer.json'))}


def _data_config(root, archive=None, **overrides):
  path, sha = archive or ('', '')
  fields = dict(dataset='shakespeare', seq_len=16, batch_size=4, vocab_size=384, data_dir=str(root),
                archive=path, archive_sha256=sha, text_key='text', tokenizer_train_bytes=0,
                tokenizer='', separator_token='')
  fields.update(overrides)
  return ml_collections.ConfigDict(fields)


# ---------------------------------------------------------------------------------------------
# Either kind behind one interface.


@pytest.mark.parametrize('kind', ['sp', 'hf'])
def test_open_tokenizer_gives_the_tokenizer_interface_for_either_kind(own, kind):
  tok = open_tokenizer(own[kind])
  ids = tok.encode(SAMPLE)
  assert ids.dtype == np.int32 and ids.ndim == 1 and len(ids) > 10
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.eos_id not in ids  # no text encodes to the separator, not even its own spelling
  assert [x.tolist() for x in tok.encode_batch([SAMPLE, 'fair is foul'])] == [
      ids.tolist(), tok.encode('fair is foul').tolist()]
  assert 'sweet prince' in tok.decode(ids) and tok.decode([tok.eos_id]) == ''
  if kind == 'sp':  # published shape: eos 2, no pad piece (padding uses the separator, masked)
    assert (tok.kind, tok.eos_id, tok.pad_id, tok.vocab_size) == ('sentencepiece', 2, 2, 320)
  else:  # byte-level BPE: exact round trip, the end-of-text token found by name
    assert tok.kind == 'huggingface' and tok.decode(ids) == SAMPLE
    assert tok.eos_id == tok.pad_id == 0 and tok.separator_token == '<|endoftext|>'
    assert tok.vocab_size == len(json.load(open(own[kind]))['model']['vocab'])


def test_a_named_separator_replaces_the_eos(own, tmp_path):
  tok = open_tokenizer(own['sp'], '<s>')
  assert tok.eos_id == 1 and tok.eos_id not in tok.encode(SAMPLE)
  hf = open_tokenizer(_train_byte_level_bpe(str(tmp_path / 'sep.json'), ('[PAD]', '<sep>', '</s>')),
                      '<sep>')
  assert (hf.eos_id, hf.pad_id) == (1, 0)
  assert open_tokenizer(str(tmp_path / 'sep.json')).separator_token == '</s>'  # found by name


def test_a_document_never_forges_the_separator_even_where_the_model_can_reach_it(tmp_path):
  """A Unigram vocabulary holds its special tokens as pieces: '</s>' in a text segments to the
  separator's id. Those spans are encoded a character at a time instead."""
  from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  unigram = HF(models.Unigram())
  unigram.pre_tokenizer = pre_tokenizers.Metaspace()
  unigram.decoder = decoders.Metaspace()
  unigram.train_from_iterator(TEXT_LINES + ['a </s> b <x>'] * 5, trainers.UnigramTrainer(
      vocab_size=150, special_tokens=['<pad>', '</s>', '<unk>'], unk_token='<unk>', show_progress=False))
  unigram.save(str(tmp_path / 'unigram.json'))
  tok = open_tokenizer(str(tmp_path / 'unigram.json'))
  text = 'thou art </s> the lord</s>'
  unigram.encode_special_tokens = True  # the library alone, special-token matching off: reached
  assert tok.eos_id in unigram.encode(text, add_special_tokens=False).ids
  ids = tok.encode(text)
  assert tok.eos_id not in ids and tok.encode_batch([text])[0].tolist() == ids.tolist()
  assert 'the lord' in tok.decode(ids)


@pytest.mark.parametrize('case,match', [
    ('sp without eos', r"^data\.tokenizer='.*noeos\.model': .* has no eos piece to separate "
                       r'documents \(eos_id -1\); name one of its control pieces in '
                       r'data\.separator_token'),
    ('hf without end-of-text', r"^data\.tokenizer='.*plain\.json': .* has no end-of-text special "
                               r'token .* name one of its special tokens in data\.separator_token'),
    ('separator not special', r"^data\.tokenizer='.*': data\.separator_token='thou' is not a "
                              r'control piece'),
    ('not a tokenizer', r"^data\.tokenizer='.*junk\.model': .* is neither a sentencepiece model "
                        r'nor a Hugging Face tokenizer\.json'),
    ('json not a tokenizer', r"^data\.tokenizer='.*vocab\.json': .*vocab\.json is a JSON object "
                             r"with the keys 'name', 'vocab', not a Hugging Face tokenizer\.json: "
                             r'it has no "model" section'),
    ('a run config', r"^data\.tokenizer='.*config\.json': .* is a JSON object with the keys "
                     r"'model', 'data', not a Hugging Face tokenizer\.json: its \"model\" section "
                     r"has no \"vocab\" \(its keys: 'name', 'd_model'\)"),
    ('truncated', r"^data\.tokenizer='.*cut\.json': .*cut\.json is not valid JSON \(Unterminated "
                  r'string starting at line \d+ column \d+\); it ends mid-way, after [\d,]+ '
                  r'bytes: truncated\? copy the whole file again$'),
    ('truncated mid-character', r"^data\.tokenizer='.*cut_utf8\.json': .*cut_utf8\.json is not "
                                r'valid JSON \(invalid UTF-8 at byte [\d,]+\); it ends mid-way'),
    ('large and truncated', r"^data\.tokenizer='.*cut_large\.json': .*cut_large\.json is not "
                            r'valid JSON \(invalid UTF-8 at byte \d+,\d{3},\d{3}\); it ends '
                            r'mid-way, after \d+,\d{3},\d{3} bytes: truncated\?'),
    ('missing file', r"^data\.tokenizer='.*absent\.model' is not an existing file"),
    ('generated dataset', r"^data\.tokenizer='.*' does not apply to the generated dataset"),
    ('separator alone', r"^data\.separator_token='</s>' only applies to a data\.tokenizer"),
])
def test_an_unusable_tokenizer_is_one_config_error(own, tmp_path, case, match):
  fields = {
      'sp without eos': lambda: dict(tokenizer=_train_sentencepiece(
          str(tmp_path / 'noeos'), eos_id=-1, bos_id=-1, byte_fallback=False, vocab_size=80)),
      'hf without end-of-text': lambda: dict(tokenizer=_train_byte_level_bpe(
          str(tmp_path / 'plain.json'), ('<mask>',))),
      'separator not special': lambda: dict(tokenizer=own['sp'], separator_token='thou'),
      'not a tokenizer': lambda: dict(tokenizer=_write(tmp_path / 'junk.model', b'\x08\x01junk')),
      'json not a tokenizer': lambda: dict(tokenizer=_write(
          tmp_path / 'vocab.json', json.dumps({'name': 'mine', 'vocab': ['a', 'b']}).encode())),
      'a run config': lambda: dict(tokenizer=_write(tmp_path / 'config.json', json.dumps(
          {'model': {'name': 'pi_attention', 'd_model': 64}, 'data': {}}).encode())),
      'truncated': lambda: dict(tokenizer=_cut(own['hf'], tmp_path / 'cut.json', at='"<|endo')),
      'truncated mid-character': lambda: dict(
          tokenizer=_cut(own['hf'], tmp_path / 'cut_utf8.json', at='\u0120'.encode()[:1])),
      'large and truncated': lambda: dict(tokenizer=_cut(
          _large(own['hf'], tmp_path / 'large.json'), tmp_path / 'cut_large.json',
          at='\u0120'.encode()[:1], last=True)),
      'missing file': lambda: dict(tokenizer=str(tmp_path / 'absent.model')),
      'generated dataset': lambda: dict(tokenizer=own['sp'], dataset='mqar:'),
      'separator alone': lambda: dict(separator_token='</s>'),
  }[case]()
  with pytest.raises(ConfigError, match=match):
    data.validate(DataConfig.from_mapping(_data_config(tmp_path / 'never', **fields)))
  assert not (tmp_path / 'never').exists()


def _write(path, payload: bytes) -> str:
  path.write_bytes(payload)
  return str(path)


def _cut(source: str, path, at, last: bool = False) -> str:
  """A copy of `source` cut just after the first (or `last`) occurrence of `at` (a copy that
  stopped part way)."""
  with open(source, 'rb') as f:
    payload = f.read()
  at = at.encode() if isinstance(at, str) else at
  end = (payload.rindex(at) if last else payload.index(at)) + len(at)
  return _write(path, payload[:end])


def _large(source: str, path) -> str:
  """`source` with 20,000 added tokens: a tokenizer.json over 1 MiB (the size past which the file
  goes to the tokenizers library unparsed), its added tokens' 'Ġ' two UTF-8 bytes each."""
  with open(source, encoding='utf-8') as f:
    record = json.load(f)
  base = max(t['id'] for t in record['added_tokens']) + len(record['model']['vocab'])
  record['added_tokens'] += [dict(id=base + i, content=f'\u0120added{i}', single_word=False,
                                  lstrip=False, rstrip=False, normalized=True, special=False)
                             for i in range(20_000)]
  payload = json.dumps(record, ensure_ascii=False).encode()
  assert len(payload) > 1 << 20
  open_tokenizer(_write(path, payload))  # whole, it opens
  return str(path)


@pytest.mark.parametrize('kind', ['sp', 'hf'])
def test_the_vocabulary_follows_the_tokenizer_whatever_the_config_says(own, kind):
  config = load_config('dense')
  config.data.tokenizer = own[kind]
  assert config.data.vocab_size == 8192  # the config file's
  run, _ = config_check.prepare(build(config), jax.devices()[:1])  # a new RunConfig: with_vocab
  size = open_tokenizer(own[kind]).vocab_size
  assert run.data.vocab_size == run.model.vocab_size == size


# ---------------------------------------------------------------------------------------------
# The token cache is keyed by the tokenizer's identity.


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp('bring_tokenizer_data')


def _first_document(stream, eos_id) -> list[int]:
  ends = np.flatnonzero(np.asarray(stream) == eos_id)
  return np.asarray(stream[ends[0] + 1:ends[1]]).tolist()


def test_each_tokenizer_gets_its_own_streams(own, shakespeare_archive, data_dir):
  own_corpus = data.load(data.validate(DataConfig.from_mapping(_data_config(data_dir, shakespeare_archive))))
  by_kind = {k: data.load(data.validate(DataConfig.from_mapping(
      _data_config(data_dir, shakespeare_archive, tokenizer=own[k])))) for k in own}
  first = own_corpus.tokenizer.decode(_first_document(own_corpus.tokens('validation'), 2))
  counts = {own_corpus.num_tokens('train')}
  for kind, corpus in by_kind.items():
    tok = corpus.tokenizer
    assert tok.model_path == own[kind] and corpus.identity['tokenizer_sha256'] == \
        archives.sha256_of(own[kind]) and corpus.identity['vocab_size'] == tok.vocab_size
    assert _first_document(corpus.tokens('validation'), tok.eos_id) == tok.encode(first).tolist()
    assert corpus.num_bytes('train') == own_corpus.num_bytes('train')  # bits per byte: the text's
    counts.add(corpus.num_tokens('train'))
  assert len(counts) == 3  # three tokenizers, three streams
  assert len(list((data_dir / 'tokens').iterdir())) == 3
  recorded = {json.load(open(meta))['tokenizer']['sha256'] for meta in data_dir.glob('tokens/*/train.json')}
  assert recorded == {archives.sha256_of(c.tokenizer.model_path) for c in (own_corpus, *by_kind.values())}


def test_a_swapped_tokenizer_file_never_reuses_the_old_stream(shakespeare_archive, tmp_path):
  """The library's own tokenizer: replacing its cached spm.model (same settings, same corpus)
  tokenizes again; the streams are the new model's."""
  config = data.validate(DataConfig.from_mapping(_data_config(tmp_path, shakespeare_archive)))
  before = data.load(config)
  spm_model = before.tokenizer.model_path
  other = Tokenizer.train(TEXT_LINES[::3], vocab_size=340, model_path=str(tmp_path / 'other.model'))
  os.replace(other.model_path, spm_model)
  after = data.load(config)
  assert after.tokenizer.model_path == spm_model
  assert after.identity['tokenizer_sha256'] != before.identity['tokenizer_sha256']
  swapped = Tokenizer(spm_model)
  doc = _first_document(after.tokens('validation'), swapped.eos_id)
  assert doc == swapped.encode(before.tokenizer.decode(_first_document(
      before.tokens('validation'), 2))).tolist()
  assert not np.array_equal(np.asarray(after.tokens('train')), np.asarray(before.tokens('train')))


def test_the_stream_key_is_the_corpus_and_the_tokenizer(own):
  sp, hf = open_tokenizer(own['sp']), open_tokenizer(own['hf'])
  corpus = {'name': 'x', 'splits': {'train': [3, 100]}}
  keys = {cache.stream_key(corpus, sp), cache.stream_key(corpus, hf),
          cache.stream_key(dict(corpus, name='y'), sp),
          cache.stream_key(corpus, open_tokenizer(own['sp'], '<s>'))}
  assert len(keys) == 4 and cache.stream_key(corpus, sp) == cache.stream_key(dict(corpus), sp)


# ---------------------------------------------------------------------------------------------
# The workdir's copy.


def test_the_workdir_keeps_one_byte_identical_copy_and_readers_open_it(own, tmp_path):
  wd = workdir_lib.Workdir(str(tmp_path / 'w'))
  config = ml_collections.ConfigDict({'data': {'tokenizer': own['sp'], 'separator_token': '<s>'}})
  sp = open_tokenizer(own['sp'], '<s>')
  wd.write(config, sp, {'tokenizer_sha256': archives.sha256_of(own['sp'])})
  assert open(wd.file('tokenizer.model'), 'rb').read() == open(own['sp'], 'rb').read()
  for path in (wd.path, wd.file('tokenizer.model')):  # the run's separator, not the file's eos
    assert open_tokenizer(path).eos_id == 1
  config.data.update(tokenizer=own['hf'], separator_token='')
  wd.write(config, open_tokenizer(own['hf']), {'tokenizer_sha256': archives.sha256_of(own['hf'])})
  assert open(wd.file('tokenizer.json'), 'rb').read() == open(own['hf'], 'rb').read()
  assert not os.path.exists(wd.file('tokenizer.model'))  # one current copy; the old one is kept
  kept = wd.file(f'tokenizer.{archives.sha256_of(own["sp"])[:12]}.model')
  assert open(kept, 'rb').read() == open(own['sp'], 'rb').read()
  tok = open_tokenizer(wd.file('tokenizer.model'))  # the path generation.load_workdir opens
  assert tok.kind == 'huggingface' and tok.model_path == wd.file('tokenizer.json')
  assert wd.tokenizer_file() == wd.file('tokenizer.json')


# ---------------------------------------------------------------------------------------------
# Through the command line: the workdir's copy, the vocabulary, the refusals.


def _cli(args_of, workdir, tokenizer, *extra):
  args = [a for a in args_of(workdir, num_steps=4, log_every=2, eval_every=4, checkpoint_every=4,
                             sample_tokens=8) if not a.startswith('--config.data.vocab_size=')]
  return [sys.executable, '-m', 'efficient_lm.main', *args, f'--config.data.tokenizer={tokenizer}',
          *extra]


def _run(args):
  return subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=600,
                        env=subprocess_env())


def _train_tokens(stderr: str) -> int:
  return int(re.search(r'Corpus\(shakespeare, vocab=\d+, tokens: train=(\d+)', stderr)[1])


@pytest.mark.slow  # two training runs on the command line, one per kind (~35 s each on 2 cores)
@pytest.mark.parametrize('kind', ['sp', 'hf'])
def test_main_trains_with_a_tokenizer_of_ones_own(own, kind, tiny_cli_args, tiny_config, tmp_path):
  workdir = tmp_path / 'w'
  given = tmp_path / os.path.basename(own[kind])  # (removed once trained: readers use the copy)
  given.write_bytes(open(own[kind], 'rb').read())
  done = _run(_cli(tiny_cli_args, str(workdir), str(given)))
  assert done.returncode == 0, done.stderr[-3000:]
  copy = workdir / ('tokenizer.model' if kind == 'sp' else 'tokenizer.json')
  assert copy.read_bytes() == open(own[kind], 'rb').read()
  assert not (workdir / ('tokenizer.json' if kind == 'sp' else 'tokenizer.model')).exists()
  size = open_tokenizer(own[kind]).vocab_size
  saved = json.load(open(workdir / 'config.json'))
  assert saved['model']['vocab_size'] == saved['data']['vocab_size'] == size
  identity = json.load(open(workdir / 'data.json'))
  assert identity['tokenizer_sha256'] == archives.sha256_of(own[kind]) and identity['vocab_size'] == size
  # The library's own tokenizer on the same data_dir gives another train token count.
  config = tiny_config()
  assert _train_tokens(done.stderr) != data.load(data.validate(DataConfig.from_mapping(config.data))).num_tokens('train')
  # What reads the workdir later opens its copy, the given file gone.
  given.unlink()
  tok = open_tokenizer(str(workdir / 'tokenizer.model'))  # the path generation.load_workdir opens
  assert tok.model_path == str(copy) and tok.encode(SAMPLE).tolist() == \
      open_tokenizer(own[kind]).encode(SAMPLE).tolist()
  workdir_lib.Workdir(str(workdir)).require_trained()
  text = tmp_path / 'text.txt'
  text.write_text(SAMPLE)
  on_text = scoring.evaluate_workdir(str(workdir), text_file=str(text))
  on_split = scoring.evaluate_workdir(str(workdir), split='validation')
  assert on_text['num_bytes'] == len(SAMPLE.encode()) and on_text['step'] == on_split['step'] == 4
  final = json.loads(done.stdout.splitlines()[-1])  # the run's final evaluation, same split
  assert on_split['bits_per_byte'] == pytest.approx(final['eval_bits_per_byte'], rel=1e-3), final


def test_a_command_line_vocab_size_that_disagrees_is_refused_before_any_work(own, tiny_cli_args,
                                                                             tmp_path):
  args = _cli(tiny_cli_args, str(tmp_path / 'w'), own['hf'], '--config.data.vocab_size=384',
              f'--config.data.data_dir={tmp_path / "fresh"}')
  done = _run(args)
  size = open_tokenizer(own['hf']).vocab_size
  errors = [line for line in done.stderr.splitlines() if line.startswith('error:')]
  assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
  assert (f'--config.data.vocab_size=384 disagrees with data.tokenizer=' in errors[0]
          and f'which has {size} ids' in errors[0]), errors
  assert 'compiling' not in done.stderr and not (tmp_path / 'fresh').exists()
  assert 'starting jax' not in done.stderr  # refused before jax starts (main's pre-jax checks)


@pytest.mark.slow  # a training run, then refusals on the command line
def test_resuming_with_another_tokenizer_is_refused_like_another_corpus(own, tiny_cli_args, tmp_path):
  workdir = tmp_path / 'w'
  done = _run(_cli(tiny_cli_args, str(workdir), own['sp']))
  assert done.returncode == 0, done.stderr[-3000:]
  moved = tmp_path / 'moved.model'  # the same file elsewhere: the same tokenizer
  moved.write_bytes(open(own['sp'], 'rb').read())
  again = _run(_cli(tiny_cli_args, str(workdir), str(moved)))
  assert again.returncode == 0, again.stderr[-3000:]
  before = {p: p.read_bytes() for p in workdir.rglob('*') if p.is_file()}
  for other, message in ((own['hf'], 'was trained on another tokenizer (tokenizer_sha256'),
                         ('', "was trained on another tokenizer (data.tokenizer='")):
    refused = _run(_cli(tiny_cli_args, str(workdir), other))
    errors = [line for line in refused.stderr.splitlines() if line.startswith('error:')]
    assert refused.returncode == 2 and len(errors) == 1 and message in errors[0], refused.stderr[-3000:]
    assert 'starting jax' not in refused.stderr  # data.json answers before jax starts
  assert {p: p.read_bytes() for p in workdir.rglob('*') if p.is_file()} == before
