"""MQAR as a corpus: `load` -> `MqarCorpus`, the `pipeline.Corpus` interface with no files.

`train_iterator` yields {inputs, targets, weights}, `eval_batches` adds `distances` (`[B, S]`,
the query's distance at each answer, -1 elsewhere); `MqarTokenizer` names the ids and records the
task in a workdir. Batches and vocabulary: docs/data.md, MQAR.
"""

import hashlib
import json
import re
from typing import Iterator

import numpy as np

from efficient_lm.data import sequence_iterator
from efficient_lm.data.mqar.sequences import batch, sequence
from efficient_lm.data.mqar.task import (EOS_ID, PAD_ID, QUERY_ID, SPLITS, MqarTask, parse,
                                         require_int, validate)
from efficient_lm.config.errors import ConfigError
from efficient_lm.data.tokenizer_protocol import TokenIds


class MqarTokenizer(TokenIds):
  """Ids <-> words: '<pad>', '<eos>', '?', 'k<i>', 'v<i>', 'f<i>' (i counts from 0 within its
  range), 'k<i>=v<j>' for a pair token (pair_tokens=1); decode of an id outside the vocabulary
  gives '<id:N>'. No sentencepiece model
  (model_path None): `save` writes the task instead (JSON: kind, dataset, vocab_size), which
  `load` reads back, so a workdir records which task it was trained on."""

  model_path = None

  def __init__(self, task: MqarTask):
    self.task = task

  @property
  def vocab_size(self) -> int:
    return self.task.vocab_size

  @property
  def eos_id(self) -> int:
    return EOS_ID

  @property
  def pad_id(self) -> int:
    return PAD_ID

  def _ranges(self):
    t = self.task
    return (('k', t.key_start, t.keys), ('v', t.value_start, t.values), ('f', t.filler_start, t.filler))

  def _word(self, i: int) -> str:
    if i in (PAD_ID, EOS_ID, QUERY_ID):
      return ('<pad>', '<eos>', '?')[i]
    for letter, start, size in self._ranges():
      if start <= i < start + size:
        return f'{letter}{i - start}'
    t = self.task
    if t.pair_tokens == 1 and t.pair_start <= i < t.vocab_size:
      return f'k{(i - t.pair_start) // t.values}=v{(i - t.pair_start) % t.values}'
    return f'<id:{i}>'

  def decode(self, ids) -> str:
    return ' '.join(self._word(int(i)) for i in np.asarray(ids).reshape(-1))

  def encode(self, text: str) -> np.ndarray:
    """int32 ids of a space-separated string of decode's words (no eos added)."""
    fixed = {'<pad>': PAD_ID, '<eos>': EOS_ID, '?': QUERY_ID}
    ids = []
    for word in text.split():
      if word in fixed:
        ids.append(fixed[word])
        continue
      pair = re.fullmatch(r'k([0-9]+)=v([0-9]+)', word)
      t = self.task
      if pair and t.pair_tokens == 1 and int(pair[1]) < t.keys and int(pair[2]) < t.values:
        ids.append(t.pair_start + int(pair[1]) * t.values + int(pair[2]))
        continue
      for letter, start, size in self._ranges():
        if word[:1] == letter and word[1:].isdigit() and int(word[1:]) < size:
          ids.append(start + int(word[1:]))
          break
      else:
        raise ValueError(f'{word!r} is not an MQAR token of {self.task.spec}; write k<i> (i < '
                         f'{self.task.keys}), v<i> (i < {self.task.values}), f<i> (i < '
                         f'{self.task.filler}), ?, <eos> or <pad>'
                         + (', or k<i>=v<j> (a pair)' if self.task.pair_tokens == 1 else ''))
    return np.asarray(ids, np.int32)

  def encode_batch(self, texts) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  @property
  def identity(self) -> dict:
    return {'kind': 'mqar', 'dataset': self.task.spec, 'vocab_size': self.vocab_size}

  def save(self, path: str) -> None:
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(self.identity, f, indent=1)

  @classmethod
  def load(cls, path: str) -> 'MqarTokenizer':
    with open(path, encoding='utf-8') as f:
      record = json.load(f)
    if record.get('kind') != 'mqar':
      raise ValueError(f'{path} does not describe an MQAR task (kind={record.get("kind")!r})')
    return cls(parse(record['dataset']))

  def __repr__(self) -> str:
    return f'MqarTokenizer({self.task.spec!r}, vocab_size={self.vocab_size})'


class MqarIterator(sequence_iterator.SequenceIterator):
  """`SequenceIterator` over a task's sequences (their distances dropped: the compiled train step
  takes inputs, targets, weights)."""

  def __init__(self, task: MqarTask, batch_size: int, seed: int, split: str, process_index: int,
               process_count: int):
    def batch_of(rows):
      out = batch(task, split, rows, seed)
      del out['distances']
      return out
    super().__init__(task.spec, task.num_sequences(split), batch_of, batch_size, seed, split,
                     process_index, process_count)


class MqarCorpus:
  """The `pipeline.Corpus` interface over generated MQAR sequences (docs/data.md, MQAR)."""

  def __init__(self, task: MqarTask, *, batch_size: int = 8):
    self.task = task
    self.name = task.spec
    self.tokenizer = MqarTokenizer(task)
    # What a workdir records (`state/workdir.py`): the task is all there is to the data.
    self.identity = {'dataset': task.spec, 'source': 'generated', 'vocab_size': task.vocab_size,
                     'tokenizer_sha256': hashlib.sha256(task.spec.encode()).hexdigest()}
    self.seq_len = task.seq_len
    self.batch_size = batch_size
    self.splits = SPLITS

  def _check(self, split: str, seq_len: int | None) -> None:
    self.task.num_sequences(split)  # raises for an unknown split
    if seq_len not in (None, self.task.seq_len):
      raise ConfigError(f'seq_len={seq_len!r} differs from the mqar window seq_len='
                        f'{self.task.seq_len}; MQAR windows are fixed: use {self.task.seq_len}')

  def num_documents(self, split: str) -> int:
    """Sequences in the split (train: TRAIN_SEQUENCES, a nominal size)."""
    return self.task.num_sequences(split)

  def num_tokens(self, split: str) -> int:
    """Targets in the split: seq_len per sequence (the answers among them: num_bytes)."""
    return self.num_documents(split) * self.task.seq_len

  def num_bytes(self, split: str) -> int:
    """MQAR has no text: the number of answers (queries x sequences), so bits per byte is bits
    per answer (every scored target is an answer)."""
    return self.num_documents(split) * self.task.queries

  def num_windows(self, split: str, *, drop_remainder: bool = False, seq_len: int | None = None) -> int:
    del drop_remainder  # one window per sequence, never partial
    self._check(split, seq_len)
    return self.num_documents(split)

  def tokens(self, split: str) -> np.ndarray:
    """validation / test as one packed stream [eos, body_0, eos, body_1, ..., eos]: window w is
    stream[w*S : w*S + S + 1], sequence w exactly. Its weights are not all 1: score MQAR with
    eval_batches, which has them."""
    if split == 'train':
      raise ValueError(f'{self.name}: the train split is generated batch by batch and has no '
                       'stream; use train_iterator, or tokens() of validation or test')
    S, n = self.task.seq_len, self.num_documents(split)
    stream = np.empty(n * S + 1, np.int32)
    for i in range(n):
      stream[i * S:(i + 1) * S + 1] = sequence(self.task, split, i)[0]
    return stream

  def train_iterator(self, batch_size: int | None = None, seed: int = 0, *, split: str = 'train',
                     seq_len: int | None = None, process_index: int = 0,
                     process_count: int = 1) -> MqarIterator:
    """Endless batches of `split` (train: fresh sequences; validation / test: cycled)."""
    batch_size = batch_size or self.batch_size
    self._check(split, seq_len)
    require_int('batch_size', batch_size, 1)
    require_int('seed', seed, 0)
    require_int('process_count', process_count, 1)
    if not 0 <= process_index < process_count:
      raise ConfigError(f'process_index={process_index!r} must be in [0, process_count='
                        f'{process_count}); pass jax.process_index() and jax.process_count()')
    return MqarIterator(self.task, batch_size, int(seed), split, process_index, process_count)

  def eval_batches(self, split: str, batch_size: int | None = None, *, seq_len: int | None = None,
                   process_index: int = 0, process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """Every sequence of `split` once, in order, as {inputs, targets, weights, distances}; the
    last global batch is padded with rows of weight 0. Each process gets its rows of every
    global batch (all yield the same number of batches)."""
    batch_size = batch_size or self.batch_size
    self._check(split, seq_len)
    n = self.num_documents(split)
    global_batch = batch_size * process_count
    for first in range(0, n, global_batch):
      start = first + process_index * batch_size
      yield batch(self.task, split, [i if i < n else None for i in range(start, start + batch_size)])

  def __repr__(self) -> str:
    return (f'MqarCorpus({self.name}, vocab={self.task.vocab_size}, '
            f'eval sequences={self.task.eval_sequences})')


def load(data_config) -> MqarCorpus:
  """`data.load` for an 'mqar:' dataset (the typed data section): validates and returns the corpus
  (nothing to prepare)."""
  return MqarCorpus(validate(data_config), batch_size=data_config.batch_size)
