"""A Hugging Face `tokenizer.json` (byte-level BPE, WordPiece, Unigram) behind `Tokenizer`'s interface.

Loaded from the file alone with the `tokenizers` library (`Tokenizer.from_file`: never the hub),
used as it is: its own normalizer, pre-tokenizer and decoder. Whatever the file sets for padding and
truncation is switched off (a document is never cut), no special token is added around a text, and
special-token strings inside a document are encoded as plain text (`encode_special_tokens`), and a
span the model still segments into the separator's piece (a Unigram vocabulary holds its special
tokens as pieces) is encoded a character at a time: a document can never forge the separator. The separator (the stream's end-of-document id) is
`separator_token` when given, else the first of `END_OF_TEXT` among its special tokens (text never
encodes to a special token, so a separator never comes from a document).
"""

import os
from typing import Sequence

import numpy as np

from efficient_lm.data import tokenizer_json
from efficient_lm.data.tokenizer_protocol import SeparatedTokenizer, int_ids

# End-of-text tokens, in the order they are looked for when `data.separator_token` is ''.
END_OF_TEXT = ('<|endoftext|>', '<|end_of_text|>', '</s>', '<eos>', '<|eos|>', '[SEP]', '<|im_end|>')
PAD_TOKENS = ('<pad>', '[PAD]', '<|pad|>', '<|padding|>')
FILE_NAME = 'tokenizer.json'  # the workdir's copy


class HFTokenizer(SeparatedTokenizer):
  """A `tokenizer.json`: a `FileTokenizer` (tokenizer_protocol), as `tokenizer.Tokenizer`."""

  kind = 'huggingface'
  file_name = FILE_NAME

  def __init__(self, path: str, separator_token: str = ''):
    import tokenizers  # pylint: disable=g-import-not-at-top  (only when such a file is used)

    self.model_path = os.fspath(path)
    try:
      self._tok = tokenizers.Tokenizer.from_file(self.model_path)
    except Exception as e:  # pylint: disable=broad-except  (the library's own exception type)
      # A file cut short, or JSON of another kind: said so, not as the library's parse error.
      tokenizer_json.check_tokenizer_json(self.model_path, tokenizer_json.read_json(self.model_path))
      raise ValueError(f'{self.model_path} is not a Hugging Face tokenizer.json the tokenizers '
                       f'library can read ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})'
                       ) from e
    self._tok.no_padding()
    self._tok.no_truncation()
    self._tok.encode_special_tokens = True
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self._vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
    specials = self.special_tokens()
    if separator_token:
      if separator_token not in specials:
        raise ValueError(f'data.separator_token={separator_token!r} is not a special token of '
                         f'{self.model_path} (the tokens no text encodes to); name one of '
                         f'{", ".join(specials[:8]) or "them (it has none)"}, or '
                         "'' for its end-of-text token")
      self.separator_token = separator_token
    else:
      found = [t for t in END_OF_TEXT if t in specials]
      if not found:
        raise ValueError(f'{self.model_path} has no end-of-text special token (none of '
                         f'{", ".join(END_OF_TEXT)}) to separate documents; name one of its '
                         'special tokens in data.separator_token '
                         f'({", ".join(specials[:8]) or "it has none"})')
      self.separator_token = found[0]
    pads = [vocab[t] for t in PAD_TOKENS if t in vocab]
    self._set_separator(vocab[self.separator_token], pads[0] if pads else None)

  def special_tokens(self) -> list[str]:
    """The file's special tokens, by id."""
    decoder = self._tok.get_added_tokens_decoder()
    return [added.content for _, added in sorted(decoder.items()) if added.special]

  @property
  def vocab_size(self) -> int:
    """One past the largest id (added tokens included): the model's vocabulary."""
    return self._vocab_size

  def encode(self, text: str) -> np.ndarray:
    """int32 ids of `text` (no special token added; never the separator)."""
    return self._without_separator(text, self._tok.encode(text, add_special_tokens=False))

  def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[np.ndarray]:
    """encode() of each text, in parallel (the library's own threads)."""
    del num_threads  # the library sizes its pool itself (RAYON_NUM_THREADS)
    texts = list(texts)
    encoded = self._tok.encode_batch(texts, add_special_tokens=False)
    return [self._without_separator(t, e) for t, e in zip(texts, encoded)]

  def _without_separator(self, text: str, encoding) -> np.ndarray:
    """The encoding's ids, where a model that can reach the separator's piece from text (a
    Unigram vocabulary holding '</s>', say) has: that span encoded a character at a time."""
    ids = np.asarray(encoding.ids, dtype=np.int32)
    hits = np.flatnonzero(ids == self._eos_id)
    if not hits.size:
      return ids
    parts, last = [], 0
    for i in hits:
      start, end = encoding.offsets[i]
      chars = [t for ch in text[start:end]
               for t in self._tok.encode(ch, add_special_tokens=False).ids if t != self._eos_id]
      parts += [ids[last:i], np.asarray(chars, dtype=np.int32)]
      last = i + 1
    return np.concatenate(parts + [ids[last:]])

  def decode(self, ids) -> str:
    """Text of `ids` (an int sequence or array); special tokens decode to ''."""
    return self._tok.decode(int_ids(ids), skip_special_tokens=True)

  def _repr_extra(self) -> str:
    return f', separator={self.separator_token!r}'
