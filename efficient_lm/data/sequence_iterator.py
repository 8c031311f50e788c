"""The iterator of the generated sources (`mqar:`, `needle:`): sequence i of a split is a pure
function of (dataset, split, seed, i), so the iterator's whole state is the next index."""

from typing import Callable

import numpy as np


class SequenceIterator:
  """Batches of `split` in order, forever: global batch b holds sequences b*G .. b*G+G-1
  (G = batch_size * process_count), of which this process yields rows process_index*batch_size
  onwards (`batch_of(rows)` builds them). get_state() is JSON-able; set_state() resumes at the next
  unseen sequence (also with another batch size or process count), and refuses a state saved for
  another dataset, split or seed."""

  def __init__(self, spec: str, num_sequences: int, batch_of: Callable[[list[int]], dict],
               batch_size: int, seed: int, split: str, process_index: int, process_count: int):
    self._spec, self._num_sequences, self._batch_of = spec, num_sequences, batch_of
    self._batch_size, self._seed, self._split = batch_size, seed, split
    self._process_index, self._process_count = process_index, process_count
    self._next = 0  # sequences of the split consumed by all processes together

  def __iter__(self) -> 'SequenceIterator':
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    first = self._next + self._process_index * self._batch_size
    rows = [(first + j) % self._num_sequences for j in range(self._batch_size)]
    self._next += self._batch_size * self._process_count
    return self._batch_of(rows)

  def _identity(self) -> dict:
    return {'dataset': self._spec, 'split': self._split, 'seed': self._seed}

  def get_state(self) -> dict:
    return {**self._identity(), 'next_sequence': self._next}

  def set_state(self, state: dict) -> None:
    mine = self._identity()
    theirs = {k: state.get(k) for k in mine}
    if theirs != mine:
      raise ValueError(f'the saved data position is for {theirs}, this iterator draws {mine}; '
                       'resume with the data.dataset and train.seed the run was started with')
    self._next = int(state['next_sequence'])
