"""The tokenizer protocol (`data.tokenizer_protocol`): the sentencepiece and tokenizer.json
tokenizers are `FileTokenizer`s sharing one separator / padding rule, MQAR's words `TokenIds`."""

import numpy as np
import pytest

from efficient_lm.data import hf_tokenizer
from efficient_lm.data import mqar
from efficient_lm.data import tokenizer as tok
from efficient_lm.data.tokenizer_protocol import FileTokenizer, SeparatedTokenizer, TokenIds


def _hf_file(path, pad: bool) -> str:
  tokenizers = pytest.importorskip('tokenizers')
  vocab = {'<|endoftext|>': 0, 'a': 1, 'b': 2, ' ': 3, **({'<pad>': 4} if pad else {})}
  t = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='a'))
  t.pre_tokenizer = tokenizers.pre_tokenizers.Split('', 'isolated')
  t.decoder = tokenizers.decoders.Fuse()  # the pieces as they are, no space between
  t.add_special_tokens(['<|endoftext|>'] + (['<pad>'] if pad else []))
  t.save(str(path))
  return str(path)


def test_file_tokenizers_follow_the_protocol(tmp_path):
  sp = tok.Tokenizer.train(['abc def\nghi ' * 50], vocab_size=300,
                           model_path=str(tmp_path / 'sp.model'))
  for t, kind in ((sp, 'sentencepiece'),
                  (hf_tokenizer.HFTokenizer(_hf_file(tmp_path / 'a.json', pad=False)), 'huggingface')):
    assert isinstance(t, SeparatedTokenizer) and isinstance(t, FileTokenizer), t
    assert t.kind == kind and isinstance(t.vocab_size, int)
    ids = t.encode('ab ab')
    assert ids.dtype == np.int32 and t.decode(ids) == 'ab ab'
    assert [list(x) for x in t.encode_batch(['ab', 'b'])] == [list(t.encode('ab')), list(t.encode('b'))]
    assert type(t).__name__ in repr(t)
  assert (sp.eos_id, sp.pad_id) == (tok.EOS_ID, tok.PAD_ID)  # its own pad piece


def test_pad_falls_back_to_the_separator(tmp_path):
  without = hf_tokenizer.HFTokenizer(_hf_file(tmp_path / 'a.json', pad=False))
  assert without.eos_id == 0 and without.pad_id == 0  # no pad token: the separator
  with_pad = hf_tokenizer.HFTokenizer(_hf_file(tmp_path / 'b.json', pad=True))
  assert with_pad.eos_id == 0 and with_pad.pad_id == 4


def test_mqar_words_are_token_ids():
  words = mqar.MqarTokenizer(mqar.parse('mqar:seq_len=64,keys=8,values=8,filler=4,pairs=4,'
                                        'queries=1,latents=16,min_distance=4,max_distance=40'))
  assert isinstance(words, TokenIds) and not isinstance(words, FileTokenizer)
  assert words.decode(words.encode('k1 v2 ?')) == 'k1 v2 ?'
