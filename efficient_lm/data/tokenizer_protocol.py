"""What every tokenizer of the library is (`TokenIds`: ids <-> text, its vocabulary, its separator
and padding ids), what a tokenizer read from a file adds (`FileTokenizer`: its kind, the file a run's
folder keeps, a batch encoder), and the part both file tokenizers share, written once
(`SeparatedTokenizer`). `tokenizer.Tokenizer` (sentencepiece), `hf_tokenizer.HFTokenizer`
(tokenizer.json) and `mqar.MqarTokenizer` (a generated task's words) declare which they follow by
subclassing it; type hints elsewhere name the protocol, not a class.
"""

from typing import ClassVar, Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class TokenIds(Protocol):
  """Ids <-> text: what the corpus, the scoring and the samplers ask of a tokenizer."""

  @property
  def vocab_size(self) -> int:
    """One past the largest id: the model's vocabulary."""

  @property
  def eos_id(self) -> int:
    """The separator: the stream's end-of-document id."""

  @property
  def pad_id(self) -> int:
    """The padding id (always under weight 0)."""

  def encode(self, text: str) -> np.ndarray:
    """int32 ids of `text` (no end-of-document id added)."""

  def decode(self, ids) -> str:
    """Text of `ids` (an int sequence or array)."""


@runtime_checkable
class FileTokenizer(TokenIds, Protocol):
  """A tokenizer read from a file (`data.tokenizer`, or one trained here): a run's folder keeps a
  copy named `file_name`; `kind` is what data.json records."""

  kind: ClassVar[str]
  file_name: ClassVar[str]
  model_path: str

  def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[np.ndarray]:
    """encode() of each text."""


def int_ids(ids) -> list[int]:
  """`ids` (an int sequence or array of any shape) as a flat list of Python ints."""
  return [int(i) for i in np.asarray(ids).reshape(-1)]


class SeparatedTokenizer(FileTokenizer):
  """The part of a file tokenizer written once: the separator and padding ids (the pad piece when
  the file has one, else the separator: padding is only ever under weight 0), and its repr. A
  subclass sets them with `_set_separator` and gives `vocab_size`, `encode`, `encode_batch`, `decode`."""

  _eos_id: int
  _pad_id: int

  def _set_separator(self, eos_id: int, pad_id: int | None) -> None:
    self._eos_id = int(eos_id)
    self._pad_id = self._eos_id if pad_id is None or pad_id < 0 else int(pad_id)

  @property
  def eos_id(self) -> int:
    """The separator: the stream's end-of-document id."""
    return self._eos_id

  @property
  def pad_id(self) -> int:
    """The file's pad piece, else the separator (padding is always under weight 0)."""
    return self._pad_id

  def _repr_extra(self) -> str:
    return ''

  def __repr__(self) -> str:
    return (f'{type(self).__name__}({self.model_path!r}, vocab_size={self.vocab_size}'
            f'{self._repr_extra()})')
