"""Needles in a text haystack: `data.dataset='needle:<options>'`, retrieval taught in text.

Each sequence (one document of `data.seq_len` tokens) is a window of the base corpus's text (its
token stream, `base=`; shakespeare by default) with needles ('The special magic number for <key>
is <7 digits>.') planted at uniformly random depths, then a question and its answer per asked
needle at the end ('What is the special magic number for <key>? The special magic number for
<key> is <7 digits>.'). Train sequences cut the base's train split, every other split's the
base split of its name (never train); sequence i of a split is a pure function of (task, split,
i) and, for train, the training seed. The tokenizer is the base corpus's. `loss=answer` puts
the weights on the answers' digits only (as MQAR's answer-only loss), `loss=answer_end` on them
and on the target after each answer's last digit (where the value ends: greedy decoding, and so
exact match, needs it), `loss=all` on every token.
`min_length=L` packs several such examples in a sequence instead, each its own document of L
tokens or more (short haystacks teach the lookup; the long ones ask for reach).

`parse(dataset)` -> `NeedleTask` (one-line ConfigError per bad option); `preflight` checks it and
the base before anything compiles; `load` -> `NeedleCorpus`, the `pipeline.Corpus` interface;
`sequence` -> `NeedleSequence` (tokens, weights, where each needle is). docs/data.md, Needles.
"""

import dataclasses
import hashlib
import logging
from typing import Any, Iterator

import numpy as np

from efficient_lm.data import corpus as corpus_lib
from efficient_lm.data import registry
from efficient_lm.data import sequence_iterator
from efficient_lm.data import source_options
from efficient_lm.data import tokenizer as tokenizer_lib
from efficient_lm.data.errors import DataError
from efficient_lm.config.data import DataConfig
from efficient_lm.config.errors import ConfigError
from efficient_lm.data.tokenizer_protocol import TokenIds

log = logging.getLogger(__name__)

PREFIX = registry.NEEDLE_PREFIX
# The sentences, here and in the needle evaluator (`efficient_lm.evaluation.long_context.needle` imports them):
# a needle, and a question that ends where the answer's value begins (' <value>.' follows).
NEEDLE = 'The special magic number for {key} is {value}.'
QUESTION = 'What is the special magic number for {key}? The special magic number for {key} is'
DIGITS = 7  # a needle's value: 7 decimal digits, the first not 0
# The key vocabulary: `keys=N` draws from the first N words.
KEY_WORDS = (
    'apple', 'river', 'garden', 'silver', 'candle', 'harbor', 'meadow', 'violin', 'lantern',
    'forest', 'marble', 'pepper', 'window', 'copper', 'falcon', 'island', 'thunder', 'velvet',
    'orchid', 'glacier', 'compass', 'saddle', 'ember', 'walnut', 'canyon', 'ribbon', 'dolphin',
    'quartz', 'tulip', 'anchor', 'beacon', 'cobalt', 'desert', 'feather', 'granite', 'hammer',
    'jasmine', 'kettle', 'lemon', 'mirror', 'nectar', 'oyster', 'pillow', 'rocket', 'saffron',
    'timber', 'umbrella', 'willow', 'almond', 'badger', 'cactus', 'dragon', 'engine', 'fossil',
    'ginger', 'helmet', 'igloo', 'jungle', 'koala', 'ladder', 'magnet', 'nutmeg', 'olive', 'parrot')
LOSSES = ('answer', 'answer_end', 'all')
DEFAULT_BASE = 'shakespeare'
TRAIN_SEQUENCES = 2**32  # the train split's nominal size (fresh haystack windows, never repeated)
MIN_HAYSTACK = 1         # haystack tokens a sequence keeps at the least


def _fail(name: str, value: Any, requirement: str, fix: str) -> None:
  source_options.fail(PREFIX, name, value, requirement, fix)


def _check_base(base: str, o: dict) -> None:
  """`base=` names a text dataset the registry knows (its value holds no comma)."""
  del o
  source = registry.lookup(base)
  if source is None or source.name == PREFIX:
    _fail('base', base, 'is not a text dataset', f"name one of {', '.join(registry.BUILT_IN)}, "
          'tfds:<name>, text:<glob> or hf:<path>')
  if not source.has_text:
    _fail('base', base, 'has no text (a generated task)',
          f'name a text dataset, e.g. base={DEFAULT_BASE}')


def _check_keys(keys: int, o: dict) -> None:
  if keys > len(KEY_WORDS):
    _fail('keys', keys, f'exceeds the {len(KEY_WORDS)} key words', f'set keys<={len(KEY_WORDS)}')
  if o['needles'] + o['distractors'] > keys:
    _fail('keys', keys, f"is below needles+distractors={o['needles'] + o['distractors']} (each "
          'needle of a sequence has its own key)', f"raise keys to at least "
          f"{o['needles'] + o['distractors']} or plant fewer needles")


def _check_loss(loss: str, o: dict) -> None:
  del o
  if loss not in LOSSES:
    _fail('loss', loss, 'is not a loss', 'write loss=answer (the answer digits only), '
          'loss=answer_end (the digits and where the value ends) or loss=all (every token)')


def _check_seed(seed: int, o: dict) -> None:
  del o
  if seed >= 2**32:
    _fail('seed', seed, 'must be below 2**32', 'set seed to a non-negative 32-bit integer')


option = source_options.option


@dataclasses.dataclass(frozen=True)
class NeedleTask:
  """One needle task: every option resolved (docs/data.md, Needles). The fields are the options
  of 'needle:key=value,...', declared with their defaults and checks (`source_options`), in the
  order of the canonical spec."""
  base: str = option(DEFAULT_BASE, check=_check_base,
                     doc='the text dataset whose windows are the haystacks')
  needles: int = option(1, least=1, doc='needles asked about (one question and answer each at '
                        'the end)')
  distractors: int = option(0, least=0, doc='needles planted but not asked about')
  keys: int = option(len(KEY_WORDS), least=1, check=_check_keys,
                     doc='the first `keys` words of KEY_WORDS are the keys')
  loss: str = option('answer', check=_check_loss, doc="'answer': weights on the answers' "
                     "digits; 'answer_end': and on the target after each answer's last digit; "
                     "'all': on every token")
  eval_sequences: int = option(256, least=1, doc='sequences of every split other than train')
  seed: int = option(0, least=0, check=_check_seed, doc="the held-out sequences' seed")
  min_length: int = option(0, least=0, in_spec=False, doc='0: one example a sequence; L: '
                           'examples of L tokens and more, packed')

  @property
  def spec(self) -> str:
    """The canonical dataset string, every option spelled out (min_length only when set, so
    the specs workdirs recorded before it existed stay the same): parse(spec) == self."""
    return source_options.spec(self, PREFIX)

  @property
  def key_words(self) -> tuple[str, ...]:
    return KEY_WORDS[:self.keys]

  def num_sequences(self, split: str) -> int:
    return TRAIN_SEQUENCES if split == 'train' else self.eval_sequences


OPTIONS = source_options.names(NeedleTask)


def parse(dataset: str) -> NeedleTask:
  """The task `dataset` ('needle:name=value,...') names; a one-line ConfigError per bad option.
  `base=` names any text dataset the registry knows (its value holds no comma)."""
  return source_options.parse(NeedleTask, PREFIX, dataset, what='a needle task',
                              example='needle:base=shakespeare,needles=2')


def base_config(data_config: DataConfig, task: NeedleTask | None = None) -> DataConfig:
  """The typed data section naming the base corpus instead (what prepares the haystack)."""
  return dataclasses.replace(data_config, dataset=(task or parse(data_config.dataset)).base)


@dataclasses.dataclass(frozen=True)
class Checked:
  """What `preflight` found: the task, and the base's own preflight result."""
  task: NeedleTask
  base: Any


def preflight(data_config: DataConfig, read: bool, base_preflight) -> Checked:
  """The task's options and the base's fields (its checks: `base_preflight`, the pipeline's
  `preflight`, handed in so that this module does not import the pipeline that dispatches to it),
  and with a `data.tokenizer` that the needles fit in `data.seq_len`: before anything compiles."""
  task = parse(data_config.dataset)
  base = base_config(data_config, task)
  checked = base_preflight(base, read=read)
  if base.tokenizer:  # the tokenizer is known now: the needles must fit
    check_fits(task, tokenizer_lib.open_given(base), data_config.seq_len)
  return Checked(task, checked)


# ----------------------------------------------------------------------------------------------
# Sequences.


@dataclasses.dataclass(frozen=True)
class NeedleSequence:
  """One sequence: x int32 [S + 1] (inputs x[:-1], targets x[1:]; x[0] and x[S] end-of-document),
  weights float32 [S] (of the targets), and per needle (asked first, in question order, then the
  distractors): its key, value, drawn depth in [0, 1), where it starts in x, and for an asked
  one where its answer's digits are scored (target positions)."""
  x: np.ndarray
  weights: np.ndarray
  keys: tuple[str, ...]
  values: tuple[str, ...]
  depths: tuple[float, ...]
  starts: tuple[int, ...]
  answers: tuple[tuple[int, ...], ...]


class _Texts:
  """The tokenizer's ids of needles and of questions with their answers, and of newline."""

  def __init__(self, tokenizer: TokenIds):
    self.tokenizer = tokenizer
    self.needle_format, self.question_format = NEEDLE, QUESTION
    ids = np.asarray(tokenizer.encode('\n')).reshape(-1)
    newline = next((int(i) for i in ids[::-1] if tokenizer.decode([int(i)]) == '\n'), None)
    if newline is None:
      raise DataError(f'{tokenizer!r} has no token for a newline (what stands for an end of '
                      'document inside a haystack); use a tokenizer with one (data.tokenizer)')
    self.newline_id = newline

  def needle_text(self, key: str, value: str) -> str:
    return ' ' + self.needle_format.format(key=key, value=value)

  def question_text(self, key: str, value: str) -> str:
    """The question and its answer: the question format, then ' <value>.'."""
    return ' ' + self.question_format.format(key=key) + f' {value}.'

  def needle(self, key: str, value: str) -> np.ndarray:
    return np.asarray(self.tokenizer.encode(self.needle_text(key, value)), np.int32)

  def question(self, key: str, value: str) -> tuple[np.ndarray, np.ndarray]:
    """The question and its answer's ids, and the positions among them of the value's digits."""
    text = self.question_text(key, value)
    ids = np.asarray(self.tokenizer.encode(text), np.int32)
    first = len(text) - len(value) - 1
    last = first + len(value)
    # Characters decoded after each prefix of the ids: token k covers [ends[k-1], ends[k]).
    ends = np.array([len(self.tokenizer.decode(ids[:k + 1])) for k in range(len(ids))])
    begins = np.concatenate([[0], ends[:-1]])
    digits = np.flatnonzero((begins < last) & (ends > first))
    return ids, digits


def _split_key(split: str) -> int:
  return int.from_bytes(hashlib.sha256(split.encode()).digest()[:4], 'little')


def _draw_value(rng) -> str:
  return str(int(rng.integers(10**(DIGITS - 1), 10**DIGITS)))


def spans(task: NeedleTask, rng, seq_len: int) -> list[int]:
  """The examples' spans in a sequence of `seq_len` targets (each an example's tokens and the
  end-of-document after it; they sum to `seq_len`): one, or with `min_length` L, spans drawn
  uniformly from [L, what is left], a draw that would leave less than L taking all of it (so
  every span is at least L)."""
  if not task.min_length or task.min_length >= seq_len:
    return [seq_len]
  out, left = [], seq_len
  while left:
    span = int(rng.integers(task.min_length, left + 1))
    out.append(left if left - span < task.min_length else span)
    left -= out[-1]
  return out


def sequence(task: NeedleTask, texts: _Texts, haystack_stream: np.ndarray, seq_len: int,
             split: str, index: int, seed: int = 0, eos_id: int = 0) -> NeedleSequence:
  """Sequence `index` of `split`: its examples (`spans`), each a window of `haystack_stream` (the
  base split's token stream), its end-of-document ids made newlines, with the needles planted
  and the questions at the end, then an end of document. `seed` (the training seed) matters for
  `train` only."""
  rng = np.random.default_rng([task.seed, _split_key(split), seed if split == 'train' else 0,
                               int(index)])
  parts, weights = [np.array([eos_id], np.int32)], np.zeros(seq_len, np.float32)
  found = {'keys': [], 'values': [], 'depths': [], 'starts': [], 'answers': []}
  where = f'{split} sequence {index}'
  for span in spans(task, rng, seq_len):
    offset = sum(len(p) for p in parts)
    example = _example(task, texts, haystack_stream, span, rng, eos_id, where)
    parts.append(example.x[1:])
    weights[offset - 1:offset - 1 + span] = example.weights
    found['keys'] += example.keys
    found['values'] += example.values
    found['depths'] += example.depths
    found['starts'] += [s + offset - 1 for s in example.starts]
    found['answers'] += [tuple(p + offset - 1 for p in a) for a in example.answers]
  x = np.concatenate(parts).astype(np.int32)
  assert len(x) == seq_len + 1, (len(x), seq_len)
  return NeedleSequence(x=x, weights=weights, **{k: tuple(v) for k, v in found.items()})


def _example(task: NeedleTask, texts: _Texts, haystack_stream: np.ndarray, span: int, rng,
             eos_id: int, where: str) -> NeedleSequence:
  """One example of `span` targets, as a sequence of its own: x = eos, haystack with the
  needles, questions and answers, eos."""
  count = task.needles + task.distractors
  keys = [task.key_words[i] for i in rng.choice(task.keys, size=count, replace=False)]
  values = [_draw_value(rng) for _ in range(count)]
  needles = [texts.needle(k, v) for k, v in zip(keys, values)]
  asked = [texts.question(k, v) for k, v in zip(keys[:task.needles], values[:task.needles])]
  tail = np.concatenate([ids for ids, _ in asked])
  H = span - 1 - len(tail) - sum(len(n) for n in needles)  # x[0], x[S]: end-of-document
  if H < MIN_HAYSTACK:
    size = (f'an example of {span} tokens (needle:min_length={task.min_length})'
            if task.min_length else f'data.seq_len={span}')
    raise DataError(f'{size} leaves {H} haystack tokens for {task.spec} ({where}: {len(tail)} '
                    f'tokens of questions and answers, {sum(len(n) for n in needles)} of '
                    'needles); raise data.seq_len (or needle:min_length) or plant fewer needles')
  n = len(haystack_stream)
  if n < H:
    raise DataError(f'the {where.split()[0]} split of {task.base} has {n} tokens, fewer than the '
                    f'{H} of a haystack of {task.spec}; lower data.seq_len or use a larger base '
                    'corpus')
  start = int(rng.integers(0, n - H + 1))
  hay = np.asarray(haystack_stream[start:start + H], np.int32)
  hay = np.where(hay == eos_id, texts.newline_id, hay)
  depths = rng.random(count)
  at = np.floor(depths * (H + 1)).astype(np.int64)  # a needle goes before haystack token at[i]
  parts, starts, done, length = [np.array([eos_id], np.int32)], [0] * count, 0, 1
  for i in np.argsort(at, kind='stable'):
    parts.append(hay[done:at[i]])
    length += at[i] - done
    starts[i] = int(length)
    parts.append(needles[i])
    length += len(needles[i])
    done = at[i]
  parts.append(hay[done:])
  length += H - done
  weights = np.zeros(span, np.float32)
  answers = []
  for ids, digits in asked:
    answers.append(tuple(int(p) for p in length + digits - 1))  # target t predicts x[t + 1]
    length += len(ids)
  parts += [tail, np.array([eos_id], np.int32)]
  x = np.concatenate(parts).astype(np.int32)
  if task.loss == 'all':
    weights[:] = 1
  else:
    weights[[p for a in answers for p in a]] = 1
    if task.loss == 'answer_end':  # the target after the last digit: '.' (or what follows it)
      weights[[a[-1] + 1 for a in answers]] = 1
  return NeedleSequence(x=x, weights=weights, keys=tuple(keys), values=tuple(values),
                        depths=tuple(float(d) for d in depths), starts=tuple(starts),
                        answers=tuple(answers))


def check_fits(task: NeedleTask, tokenizer: TokenIds, seq_len: int) -> None:
  """ConfigError (needle:min_length, data.seq_len) when the longest keys' needles and questions
  (with 9999999) leave no haystack in an example of `min_length` or in `seq_len` tokens."""
  texts = _Texts(tokenizer)
  value = '9' * DIGITS
  needle_N = sorted((len(texts.needle(k, value)) for k in task.key_words), reverse=True)
  question_N = sorted((len(texts.question(k, value)[0]) for k in task.key_words), reverse=True)
  used = 2 + sum(needle_N[:task.needles + task.distractors]) + sum(question_N[:task.needles])
  if task.min_length and task.min_length < seq_len and task.min_length - used < MIN_HAYSTACK:
    raise ConfigError(f'needle:min_length={task.min_length} cannot hold an example of '
                      f'{task.spec}: its needles, questions and answers take up to {used} tokens '
                      f'of {tokenizer!r}; raise min_length to at least {used + 64}')
  if seq_len - used < MIN_HAYSTACK:
    raise ConfigError(f'data.seq_len={seq_len} cannot hold {task.spec}: its needles, questions '
                      f'and answers take up to {used} tokens of {tokenizer!r}; raise data.seq_len '
                      f'to at least {used + 64} or plant fewer needles')


# ----------------------------------------------------------------------------------------------
# The corpus and its iterator.


def _batch(corpus: 'NeedleCorpus', split: str, indices, seed: int = 0) -> dict[str, np.ndarray]:
  """inputs, targets, weights (and segment_ids with document ids) `[B, S]` of sequences
  `indices`; an index of None gives a padding row (pad ids, weight 0)."""
  S = corpus.seq_len
  x_BS1 = np.full((len(indices), S + 1), corpus.tokenizer.pad_id, np.int32)
  weights_BS = np.zeros((len(indices), S), np.float32)
  for row, index in enumerate(indices):
    if index is not None:
      s = corpus.sequence(split, index, seed)
      x_BS1[row], weights_BS[row] = s.x, s.weights
  out = {'inputs': x_BS1[:, :-1], 'targets': x_BS1[:, 1:], 'weights': weights_BS}
  if corpus.document_mask:
    out['segment_ids'] = corpus_lib.document_ids(out['inputs'], corpus.tokenizer.eos_id)
  return out


class NeedleIterator(sequence_iterator.SequenceIterator):
  """`SequenceIterator` over a needle task's sequences."""

  def __init__(self, corpus: 'NeedleCorpus', batch_size: int, seed: int, split: str,
               process_index: int, process_count: int):
    super().__init__(corpus.task.spec, corpus.task.num_sequences(split),
                     lambda rows: _batch(corpus, split, rows, seed), batch_size, seed, split,
                     process_index, process_count)


class NeedleCorpus:
  """The `pipeline.Corpus` interface over needle sequences cut from a base corpus (`base`, a
  loaded `corpus.Corpus`): its tokenizer, its splits."""

  def __init__(self, task: NeedleTask, base, *, seq_len: int, batch_size: int,
               document_mask: bool = True):
    self.task = task
    self.base = base
    self.name = task.spec
    self.tokenizer = base.tokenizer
    self.seq_len = seq_len
    self.batch_size = batch_size
    self.document_mask = document_mask
    self.splits = base.splits
    self.identity = dict(base.identity, dataset=task.spec)
    self._texts = _Texts(self.tokenizer)
    self._held_out: dict[str, list[NeedleSequence]] = {}

  def _check(self, split: str, seq_len: int | None) -> None:
    if split not in self.splits:
      raise ValueError(f'{self.name} has no split {split!r}; it has {self.splits}')
    if seq_len not in (None, self.seq_len):
      raise ConfigError(f'seq_len={seq_len!r} differs from the needle sequences\' data.seq_len='
                        f'{self.seq_len}; use {self.seq_len}')

  def sequence(self, split: str, index: int, seed: int = 0) -> NeedleSequence:
    """Sequence `index` of `split` (`seed`: the training seed, train only)."""
    self._check(split, None)
    if split != 'train' and index < self.task.eval_sequences and split in self._held_out:
      return self._held_out[split][index]
    return sequence(self.task, self._texts, self.base.tokens(split), self.seq_len, split, index,
                    seed, self.tokenizer.eos_id)

  def held_out(self, split: str) -> list[NeedleSequence]:
    """Every sequence of a split other than train (made once)."""
    if split == 'train':
      raise ValueError(f'{self.name}: the train split is drawn batch by batch; use train_iterator')
    self._check(split, None)
    if split not in self._held_out:
      self._held_out[split] = [
          sequence(self.task, self._texts, self.base.tokens(split), self.seq_len, split, i, 0,
                   self.tokenizer.eos_id) for i in range(self.task.eval_sequences)]
    return self._held_out[split]

  def num_documents(self, split: str) -> int:
    """Sequences in the split (train: TRAIN_SEQUENCES, a nominal size)."""
    self._check(split, None)
    return self.task.num_sequences(split)

  def num_tokens(self, split: str) -> int:
    """Targets in the split: seq_len per sequence (the weighted ones among them: num_bytes)."""
    return self.num_documents(split) * self.seq_len

  def num_bytes(self, split: str) -> int:
    """UTF-8 bytes of the text the weighted targets spell: with loss=all every sequence's text
    (haystack, needles, questions, answers), with loss=answer the answers' digits (and what the
    tokens holding them hold beside, a space; loss=answer_end: and what ends each). Held-out
    splits only: train's is nominal."""
    if split == 'train':
      return self.num_tokens(split)
    decode = self.tokenizer.decode
    return sum(len(decode(s.x[1:][s.weights > 0]).encode('utf-8')) for s in self.held_out(split))

  def num_windows(self, split: str, *, drop_remainder: bool = False, seq_len: int | None = None) -> int:
    del drop_remainder  # one window per sequence, never partial
    self._check(split, seq_len)
    return self.num_documents(split)

  def tokens(self, split: str) -> np.ndarray:
    """A held-out split as one packed stream [eos, body_0, eos, body_1, ..., eos]: window w is
    stream[w*S : w*S + S + 1], sequence w exactly (every token scored: eval_batches has the
    weights of loss=answer)."""
    S, sequences = self.seq_len, self.held_out(split)
    stream = np.empty(len(sequences) * S + 1, np.int32)
    for i, s in enumerate(sequences):
      stream[i * S:(i + 1) * S + 1] = s.x
    return stream

  def train_iterator(self, batch_size: int | None = None, seed: int = 0, *, split: str = 'train',
                     seq_len: int | None = None, process_index: int = 0,
                     process_count: int = 1) -> NeedleIterator:
    """Endless batches of `split` (train: fresh sequences; the others: cycled)."""
    batch_size = batch_size or self.batch_size
    self._check(split, seq_len)
    for name, value, least in (('batch_size', batch_size, 1), ('seed', seed, 0),
                               ('process_count', process_count, 1)):
      if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= least):
        raise ConfigError(f'{name}={value!r} must be an integer >= {least}; pass an integer >= {least}')
    if not 0 <= process_index < process_count:
      raise ConfigError(f'process_index={process_index!r} must be in [0, process_count='
                        f'{process_count}); pass jax.process_index() and jax.process_count()')
    return NeedleIterator(self, batch_size, int(seed), split, process_index, process_count)

  def eval_batches(self, split: str, batch_size: int | None = None, *, seq_len: int | None = None,
                   process_index: int = 0, process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """Every sequence of `split` once, in order; the last global batch is padded with rows of
    weight 0. Each process gets its rows of every global batch."""
    batch_size = batch_size or self.batch_size
    self._check(split, seq_len)
    n = len(self.held_out(split))
    global_batch = batch_size * process_count
    for first in range(0, n, global_batch):
      start = first + process_index * batch_size
      yield _batch(self, split, [i if i < n else None for i in range(start, start + batch_size)])

  def __repr__(self) -> str:
    sizes = ', '.join(f'{s}={self.base.num_tokens(s)}' for s in self.base.splits)
    return (f'NeedleCorpus({self.name}, vocab={self.tokenizer.vocab_size}, haystack tokens of '
            f'{self.task.base}: {sizes}; {self.task.eval_sequences} sequences of '
            f'{self.seq_len} per held-out split)')


def load(data_config: DataConfig, checked: Checked, base_load) -> NeedleCorpus:
  """`data.load` for a 'needle:' dataset: the base corpus prepared and loaded by `base_load` (the
  pipeline's `load`: its cache and tokenizer, as `data.dataset=<base>` would), the sequences
  drawn from it. `checked`: what `preflight` returned."""
  task = checked.task
  base = base_load(base_config(data_config, task), checked.base)
  seq_len = data_config.seq_len
  check_fits(task, base.tokenizer, seq_len)
  for split in base.splits:  # a haystack is shorter than a window: a window's worth always fits
    if len(base.tokens(split)) < seq_len:
      raise DataError(f'the {split} split of {task.base} has {len(base.tokens(split))} tokens, '
                      f'fewer than data.seq_len={seq_len}: too short to cut needle haystacks from; '
                      'lower data.seq_len or use a larger base corpus')
  corpus = NeedleCorpus(task, base, seq_len=seq_len,
                        batch_size=data_config.batch_size,
                        document_mask=data_config.document_mask)  # text: `has_document_ids`
  log.info('%r', corpus)
  return corpus
