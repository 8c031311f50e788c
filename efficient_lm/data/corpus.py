"""A tokenized corpus: each split's token stream, the tokenizer, and the Grain iterators over them.

Packing: window w of a split is stream[w*S : w*S + S + 1] (consecutive windows share one token),
inputs = window[:-1], targets = window[1:], so every token after the first is a target exactly
once. With `document_mask` a batch also carries `segment_ids` (`document_ids`): an
end-of-document token opens the next document (it is what precedes a document's first token). The training iterator shuffles whole windows anew each epoch; its state is a small JSON-able
dict, checkpointed with the model, so a resumed run sees exactly the batches it would have.
"""

import dataclasses
from typing import Callable, Iterator

import numpy as np

from efficient_lm.data import round_trip as round_trip_lib
from efficient_lm.config.errors import require, require_positive_int
from efficient_lm.data.tokenizer_protocol import TokenIds


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def document_ids(inputs_BT: np.ndarray, eos_id: int) -> np.ndarray:
  """`[B, T]` int32: each input's document in its row, counted from 0; an end-of-document token
  belongs to the document it opens."""
  return np.cumsum(np.asarray(inputs_BT) == eos_id, axis=1, dtype=np.int32)


@dataclasses.dataclass(frozen=True)
class Split:
  tokens: np.ndarray  # int32 stream, memory-mapped
  num_bytes: int
  num_documents: int


class Corpus:
  """A tokenized corpus: token streams per split, the tokenizer, and batch iterators."""

  def __init__(self, *, name: str, tokenizer: TokenIds, splits: dict[str, Split], seq_len: int,
               batch_size: int, identity: dict | None = None, document_mask: bool = False,
               round_trip: Callable[[str], dict] | None = None):
    self.name = name
    self._round_trip = round_trip  # (`data.round_trip.Measured`)
    # What the corpus is (a workdir records it: `state/workdir.py`): dataset, a fingerprint of its
    # source, the tokenizer's sha256 and vocabulary size.
    self.identity = identity or {}
    self.tokenizer = tokenizer
    self._splits = splits
    self.seq_len = seq_len
    self.batch_size = batch_size
    self.document_mask = document_mask

  @property
  def splits(self) -> tuple[str, ...]:
    return tuple(self._splits)

  def _split(self, split: str) -> Split:
    if split not in self._splits:
      raise ValueError(f'{self.name} has no split {split!r}; it has {self.splits}')
    return self._splits[split]

  def tokens(self, split: str) -> np.ndarray:
    """The packed int32 stream: eos, then each document followed by eos."""
    return self._split(split).tokens

  def num_bytes(self, split: str) -> int:
    """UTF-8 bytes of the split's documents (the denominator of bits per byte)."""
    return self._split(split).num_bytes

  def num_documents(self, split: str) -> int:
    return self._split(split).num_documents

  def round_trip(self, split: str) -> dict | None:
    """How the tokenizer gives back the split's documents (`data.round_trip.measure`: documents,
    bytes, lost_documents, lost_bytes, example), measured once and kept beside the streams; None
    where nothing measures it (a corpus made by hand)."""
    self._split(split)
    return None if self._round_trip is None else self._round_trip(split)

  def num_tokens(self, split: str) -> int:
    """Tokens scored over the split: each document's tokens plus its end-of-document token."""
    return len(self._split(split).tokens) - 1

  def num_windows(self, split: str, *, drop_remainder: bool = False, seq_len: int | None = None) -> int:
    seq_len = seq_len or self.seq_len
    n = self.num_tokens(split)
    return n // seq_len if drop_remainder else -(-n // seq_len)

  def train_iterator(self, batch_size: int | None = None, seed: int = 0, *, split: str = 'train',
                     seq_len: int | None = None, process_index: int = 0, process_count: int = 1):
    """Infinite grain DatasetIterator of shuffled training batches (see pipeline.train_dataset)."""
    return iter(self.train_dataset(batch_size, seed, split=split, seq_len=seq_len,
                                   process_index=process_index, process_count=process_count))

  def train_dataset(self, batch_size: int | None = None, seed: int = 0, *, split: str = 'train',
                    seq_len: int | None = None, process_index: int = 0, process_count: int = 1):
    """grain IterDataset: full windows of `split`, shuffled anew each epoch, batched.

    Each of `process_count` processes gets `batch_size` rows of the same global batch of
    batch_size * process_count windows (rows process_index*batch_size onwards). Partial last
    windows are dropped. The iterator's get_state() is a small JSON-able dict; set_state()
    on a fresh iterator from the same arguments resumes exactly.
    """
    import grain  # pylint: disable=g-import-not-at-top

    batch_size = batch_size or self.batch_size
    seq_len = seq_len or self.seq_len
    require_positive_int('batch_size', batch_size)
    require_positive_int('seq_len', seq_len)
    require(_is_int(seed) and 0 <= seed < 2**32, 'seed', seed, 'must be an integer in [0, 2**32)',
            'pass a non-negative 32-bit seed')
    require(_is_int(process_count) and process_count >= 1 and 0 <= process_index < process_count,
            'process_index', process_index, f'must be in [0, process_count={process_count})',
            'pass jax.process_index() and jax.process_count()')
    num_windows = self.num_windows(split, drop_remainder=True, seq_len=seq_len)
    require(num_windows > 0, 'data.seq_len', seq_len,
            f'is longer than the {split!r} split ({self.num_tokens(split)} tokens)', 'lower data.seq_len')
    eos = self.tokenizer.eos_id if self.document_mask else None
    gather = _TrainGather(self.tokens(split), seq_len, batch_size, process_index, eos)
    ds = (grain.MapDataset.range(num_windows)
          .shuffle(seed=int(seed))
          .repeat(None)
          .batch(batch_size * process_count, drop_remainder=True)
          .map(gather))
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=8))

  def eval_batches(self, split: str, batch_size: int | None = None, *, seq_len: int | None = None,
                   process_index: int = 0, process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """Every target token of `split` exactly once, in order; padding has weight 0.

    Windows are taken in stream order; the last window and the last batch are padded with
    pad_id and weight 0. With several processes each gets its rows of every global batch
    (all processes yield the same number of batches).
    """
    batch_size = batch_size or self.batch_size
    seq_len = seq_len or self.seq_len
    require_positive_int('batch_size', batch_size)
    require_positive_int('seq_len', seq_len)
    tokens = self.tokens(split)
    n = len(tokens)
    pad = self.tokenizer.pad_id
    num_windows = self.num_windows(split, seq_len=seq_len)
    global_batch = batch_size * process_count
    offsets = np.arange(seq_len + 1, dtype=np.int64)
    for first in range(0, num_windows, global_batch):
      rows = first + process_index * batch_size + np.arange(batch_size, dtype=np.int64)
      positions = rows[:, None] * seq_len + offsets[None, :]
      valid = positions < n
      window = np.asarray(tokens[np.minimum(positions, n - 1)], dtype=np.int32)
      window = np.where(valid, window, pad).astype(np.int32)
      batch = {
          'inputs': window[:, :-1],
          'targets': window[:, 1:],
          'weights': valid[:, 1:].astype(np.float32),
      }
      if self.document_mask:
        batch['segment_ids'] = document_ids(batch['inputs'], self.tokenizer.eos_id)
      yield batch

  def __repr__(self) -> str:
    sizes = ', '.join(f'{s}={self.num_tokens(s)}' for s in self.splits)
    return f'Corpus({self.name}, vocab={self.tokenizer.vocab_size}, tokens: {sizes})'


def without_text(corpus, split: str) -> str | None:
  """Why `split` of `corpus` cannot be scored at all, 'has no text (N documents, all empty)': none
  of its documents has a byte; None when it can."""
  if corpus.num_bytes(split) > 0:
    return None
  return f'has no text ({corpus.num_documents(split):,} documents, all empty)'


def bits_per_byte_withheld(corpus, split: str) -> str | None:
  """Why bits per byte of `split` is left out (null, with this reason): the split has no text, or
  the tokenizer does not give its documents back (`round_trip`; docs/data.md, Bits per byte); None
  when it is reported. A generated task's corpus (MQAR, needle) measures no round trip: its own
  figure stands."""
  empty = without_text(corpus, split)
  if empty:
    return f'the {split} split {empty}'
  measured = getattr(corpus, 'round_trip', None)
  return round_trip_lib.withheld(measured(split), split) if measured else None


class _TrainGather:
  """Maps a global batch of window indices to this process's (inputs, targets, weights)."""

  def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, process_index: int,
               eos_id: int | None = None):
    self._tokens = tokens
    self._eos_id = eos_id  # None: no document ids
    self._seq_len = seq_len
    self._rows = slice(process_index * batch_size, (process_index + 1) * batch_size)
    self._offsets = np.arange(seq_len + 1, dtype=np.int64)

  def __call__(self, window_ids) -> dict[str, np.ndarray]:
    starts = np.asarray(window_ids, dtype=np.int64)[self._rows] * self._seq_len
    window = np.asarray(self._tokens[starts[:, None] + self._offsets[None, :]], dtype=np.int32)
    batch = {
        'inputs': window[:, :-1],
        'targets': window[:, 1:],
        'weights': np.ones(window[:, 1:].shape, np.float32),
    }
    if self._eos_id is not None:
      batch['segment_ids'] = document_ids(batch['inputs'], self._eos_id)
    return batch
