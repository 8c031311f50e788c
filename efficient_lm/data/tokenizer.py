"""Sentencepiece tokenizer whose decode(encode(s)) == s for any text (docs/data.md).

Settings: unigram model, byte fallback (any character outside the vocabulary
becomes its UTF-8 bytes), identity normalisation, whitespace kept as is, no
dummy prefix, '\\n' a user-defined symbol (sentencepiece trains on lines, so
the newline is a piece of its own). The one character sentencepiece itself
cannot round-trip, its whitespace marker U+2581, is encoded here as its three
byte pieces, which decode back to it.

Ids: 0 <pad>, 1 <unk>, 2 </s> (end of document), 3 '\\n', 4..259 the byte pieces.

`data.tokenizer` brings a tokenizer of one's own instead, used as it is: any sentencepiece
`.model` (`Tokenizer`, its eos or a named piece the separator) or a Hugging Face `tokenizer.json`
(`hf_tokenizer.HFTokenizer`); `open_tokenizer` opens either, or a workdir's copy.
"""

import functools
import io
import os
import tempfile
import threading
from typing import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from efficient_lm.config.errors import ConfigError
from efficient_lm.runtime import files
from efficient_lm.runtime import progress
from efficient_lm.data import hf_tokenizer
from efficient_lm.data import mqar
from efficient_lm.data.tokenizer_json import check_tokenizer_json, read_json
from efficient_lm.data.tokenizer_protocol import SeparatedTokenizer, int_ids

PAD_ID, UNK_ID, EOS_ID = 0, 1, 2
NEWLINE = '\n'
_MARKER = '\u2581'  # sentencepiece's whitespace marker
_MAX_LINE_CHARS = 8192  # longer lines are cut into pieces for training

# Everything that changes the trained model; part of the cache key. The trainer is deterministic
# under them: it reads every line in order (no sampling: `input_sentence_size` 0), and
# `num_threads` is fixed because it is how sentencepiece splits its sums, not only how many
# threads run them (each thread sums its share of the lines; the float scores depend on the
# split). So the same text gives a byte-identical model whatever the host's cores, folder or
# run (`Tokenizer.train`).
TRAINER_SETTINGS = dict(
    model_type='unigram',
    byte_fallback=True,
    normalization_rule_name='identity',
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    user_defined_symbols=[NEWLINE],
    allow_whitespace_only_pieces=True,
    split_digits=False,
    character_coverage=0.9995,
    hard_vocab_limit=False,
    pad_id=PAD_ID,
    unk_id=UNK_ID,
    eos_id=EOS_ID,
    bos_id=-1,
    max_sentence_length=4 * _MAX_LINE_CHARS,
    input_sentence_size=0,
    num_threads=16,
)

# The fewest pieces a model can have: specials, '\n' and the 256 byte pieces.
NUM_RESERVED_PIECES = 260
FILE_NAME = 'tokenizer.model'  # the workdir's copy of a sentencepiece model


class VocabTooSmallError(ValueError):
  """The requested vocabulary cannot hold the corpus' characters plus the reserved pieces."""


def training_lines(texts: Iterable[str], max_bytes: int = 0, fraction: float = 1.0,
                   counts: dict | None = None):
  """Lines (without newlines, non-empty) of `texts`, stopping after `max_bytes` UTF-8 bytes (0 = all).

  `fraction` < 1 keeps about that share of every text (its first lines): a sample spread over
  every document of the split, not its first documents only. `counts` (if given) is kept up to
  date: 'documents' read and 'bytes' passed on."""
  counts = {} if counts is None else counts
  counts.update(documents=0, bytes=0, finished=False)
  try:
    yield from _lines(texts, max_bytes, fraction, counts)
  finally:
    counts['finished'] = True


def _lines(texts, max_bytes, fraction, counts):
  used = 0
  for text in texts:
    counts['documents'] += 1
    if fraction < 1.0:
      text = text[:max(1, int(len(text) * fraction) + 1)]
    for line in text.split(NEWLINE):
      if max_bytes:
        room = max_bytes - used
        if room <= 0:
          return
        encoded = line.encode('utf-8')
        if len(encoded) + 1 > room:
          line = encoded[:room].decode('utf-8', errors='ignore')
        used += len(encoded) + 1
      counts['bytes'] += len(line.encode('utf-8')) + 1
      for start in range(0, len(line), _MAX_LINE_CHARS):
        piece = line[start:start + _MAX_LINE_CHARS]
        if piece:
          yield piece


class Tokenizer(SeparatedTokenizer):
  """A sentencepiece model: end-of-document id, pad id, and (with byte fallback) exact round trip.

  `own`: the model must be one `train` wrote (eos, pad, byte fallback). Otherwise any model with
  an eos piece, or a named `separator_token` piece, is used as it is (unk 0, bos 1, eos 2 and no
  pad, as most published models are; with or without byte fallback). The separator is the
  stream's end-of-document id (`eos_id`); with no pad piece the padding id is the separator
  (padding is always under weight 0)."""

  kind = 'sentencepiece'
  file_name = FILE_NAME

  def __init__(self, model_path: str, separator_token: str = '', *, own: bool = False):
    self.model_path = os.fspath(model_path)
    self._sp = spm.SentencePieceProcessor(model_file=self.model_path)
    byte_ids = [self._sp.piece_to_id(f'<0x{b:02X}>') for b in _MARKER.encode('utf-8')]
    has_bytes = all(self._sp.IsByte(i) for i in byte_ids)
    self._marker_ids = byte_ids if has_bytes else None  # else the marker goes to the model as is
    if own and (self._sp.eos_id() < 0 or self._sp.pad_id() < 0 or not has_bytes):
      raise ValueError(f'{self.model_path} was not trained by Tokenizer.train (needs eos, pad, '
                       'byte fallback)')
    if separator_token:
      sep = self._sp.piece_to_id(separator_token)
      if self._sp.id_to_piece(sep) != separator_token or not self._sp.IsControl(sep):
        raise ValueError(f'data.separator_token={separator_token!r} is not a control piece of '
                         f'{self.model_path} (the pieces no text encodes to); name one of '
                         f'{", ".join(self._control_pieces()[:8]) or "them (it has none)"}, or '
                         "'' for its eos")
      eos_id = sep
    else:
      if self._sp.eos_id() < 0:
        raise ValueError(f'{self.model_path} has no eos piece to separate documents (eos_id -1); '
                         'name one of its control pieces in data.separator_token '
                         f'({", ".join(self._control_pieces()[:8]) or "it has no control pieces"})')
      eos_id = self._sp.eos_id()
    self._set_separator(eos_id, self._sp.pad_id())

  def _control_pieces(self) -> list[str]:
    return [self._sp.id_to_piece(i) for i in range(self._sp.get_piece_size())
            if self._sp.IsControl(i)]

  @classmethod
  def train(cls, texts: Iterable[str], *, vocab_size: int, model_path: str,
            max_bytes: int = 0, fraction: float = 1.0) -> 'Tokenizer':
    """Trains on `texts` (at most `max_bytes` UTF-8 bytes, 0 = all; `fraction` of each text) and
    writes `model_path`.

    Deterministic: the same texts and settings give a byte-identical file on every run, in any
    folder, on any number of cores (`TRAINER_SETTINGS`; the model is taken from the trainer as
    bytes, so no temporary path is recorded in it). The file appears atomically (written beside
    it, then renamed). The model may hold fewer than `vocab_size` pieces when the text is too
    small to fill it. Training runs in a thread while this one waits, so a stop signal is
    honoured at once (`signals`: nothing is written), and a progress line every 20 s says how
    far it is.
    """
    model_path = os.fspath(model_path)
    directory = os.path.dirname(os.path.abspath(model_path))
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
      outcome, counts, model = {}, {'documents': 0, 'bytes': 0}, io.BytesIO()

      def work():
        try:
          spm.SentencePieceTrainer.train(
              sentence_iterator=training_lines(texts, max_bytes, fraction, counts),
              model_writer=model, vocab_size=vocab_size, minloglevel=2, **TRAINER_SETTINGS)
        except BaseException as e:  # pylint: disable=broad-except  (re-raised by the caller)
          outcome['error'] = e

      def status() -> str:
        read = f"{counts['documents']:,} documents read ({progress.size(counts['bytes'])})"
        return f'all {read}, fitting the pieces' if counts.get('finished') else read

      thread = threading.Thread(target=work, name='tokenizer training', daemon=True)
      with progress.phase(f'training a {vocab_size:,}-piece tokenizer', status=status):
        thread.start()
        while thread.is_alive():
          thread.join(timeout=0.5)
      error = outcome.get('error')
      if isinstance(error, RuntimeError) and (
          'required_chars' in str(error) or 'Vocabulary size is smaller' in str(error)):
        raise VocabTooSmallError(
            f'vocab_size={vocab_size} is too small for this corpus ({error}); it must hold the '
            f'{NUM_RESERVED_PIECES} reserved pieces plus one per distinct character') from error
      if error is not None:
        raise error
      written = os.path.join(tmp, 'spm.model')
      with open(written, 'wb') as f:
        f.write(model.getvalue())
      os.replace(written, model_path)
    return cls(model_path, own=True)

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def _encode_ids(self, text: str) -> list[int]:
    if _MARKER not in text or self._marker_ids is None:
      return self._sp.encode(text)
    ids = []
    for i, part in enumerate(text.split(_MARKER)):
      if i:
        ids.extend(self._marker_ids)
      if part:
        ids.extend(self._sp.encode(part))
    return ids

  def encode(self, text: str) -> np.ndarray:
    """int32 ids of `text` (no end-of-document id added)."""
    return np.asarray(self._encode_ids(text), dtype=np.int32)

  def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[np.ndarray]:
    """encode() of each text, the marker-free ones in parallel."""
    texts = list(texts)
    plain = [i for i, t in enumerate(texts) if _MARKER not in t or self._marker_ids is None]
    out: list = [None] * len(texts)
    if plain:
      encoded = self._sp.encode([texts[i] for i in plain], num_threads=num_threads or os.cpu_count() or 1)
      for i, ids in zip(plain, encoded):
        out[i] = np.asarray(ids, dtype=np.int32)
    for i, t in enumerate(texts):
      if out[i] is None:
        out[i] = self.encode(t)
    return out

  def decode(self, ids) -> str:
    """Text of `ids` (an int sequence or array); pad and end-of-document ids decode to ''."""
    return self._sp.decode(int_ids(ids))


_PARSED_LIMIT = 1 << 20  # a generated task's description is a few hundred bytes: larger JSON
                         # files go to the tokenizers library unparsed (it reads them anyway)


def _json_kind(path: str) -> str:
  """'huggingface' or 'generated' for a JSON file (`open_file`); a ValueError, one line, saying
  what the file is and what it lacks when it is neither."""
  if os.path.getsize(path) > _PARSED_LIMIT:
    return 'huggingface'
  record = read_json(path)
  if isinstance(record, dict) and 'kind' in record and 'model' not in record:
    return 'generated'  # (its loader names a kind it does not know)
  check_tokenizer_json(path, record)
  return 'huggingface'


FILES = (FILE_NAME, 'tokenizer.json')  # the copy a run's folder (a workdir, an export) keeps


def folder_file(folder: str) -> str:
  """The tokenizer file a run's folder holds: tokenizer.model or tokenizer.json; where both are
  there (a switch cut short), the one its data.json's `tokenizer_sha256` names. The path of
  tokenizer.model when it holds neither (its absence is the caller's to report)."""
  import json  # pylint: disable=g-import-not-at-top
  present = [os.path.join(folder, n) for n in FILES if os.path.isfile(os.path.join(folder, n))]
  if len(present) > 1:
    try:
      with open(os.path.join(folder, 'data.json'), encoding='utf-8') as f:
        sha = json.load(f).get('tokenizer_sha256')
    except (OSError, ValueError, AttributeError):
      sha = None
    present = [p for p in present if files.sha256_of(p) == sha] or present
  return present[0] if present else os.path.join(folder, FILE_NAME)


def open_tokenizer(path: str, separator_token: str = ''):
  """The tokenizer at `path`, used as it is (`open_file`). A training workdir (or an export), or
  its tokenizer file (tokenizer.model / tokenizer.json: what `inference.restore` opens),
  gives the folder's copy of either kind (`folder_file`), with the separator its run used
  (`run_separator`)."""
  path = os.path.expanduser(os.fspath(path))
  if os.path.isdir(path):
    return open_file(folder_file(path), separator_token or run_separator(path))
  if not separator_token and os.path.basename(path) in FILES:
    folder = os.path.dirname(path)
    if not os.path.exists(path):  # a workdir's tokenizer.model, where it holds tokenizer.json
      path = folder_file(folder)
    separator_token = run_separator(folder)
  return open_file(path, separator_token)


def run_separator(folder: str) -> str:
  """`data.separator_token` of the run whose config.json is in `folder` ('' when there is none,
  or it is not a run's)."""
  import json  # pylint: disable=g-import-not-at-top
  try:
    with open(os.path.join(folder, 'config.json'), encoding='utf-8') as f:
      config = json.load(f)
  except (OSError, ValueError):
    return ''
  section = config.get('data') if isinstance(config, dict) else None
  separator = section.get('separator_token', '') if isinstance(section, dict) else ''
  return separator if isinstance(separator, str) else ''


def open_file(path: str, separator_token: str = ''):
  """The tokenizer file at `path`: a sentencepiece model (`Tokenizer`), a Hugging Face
  tokenizer.json (`hf_tokenizer.HFTokenizer`), or a generated task's description (JSON, e.g.
  MQAR's: `data.mqar.MqarTokenizer`). The separator is `separator_token`, '' = the file's eos /
  end-of-text token. ValueError, one line, for a file that is none of these or has no separator."""
  with open(path, 'rb') as f:
    head = f.read(64).lstrip()
  if head[:1] in (b'{', b'['):
    if _json_kind(path) == 'huggingface':
      return hf_tokenizer.HFTokenizer(path, separator_token)
    return mqar.MqarTokenizer.load(path)
  try:
    return Tokenizer(path, separator_token)
  except (RuntimeError, OSError) as e:  # sentencepiece's parse error
    raise ValueError(f'{path} is neither a sentencepiece model nor a Hugging Face tokenizer.json '
                     f'({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})') from e


@functools.lru_cache(maxsize=8)
def _opened(path: str, separator_token: str, stamp: tuple):
  del stamp  # part of the key only: a file rewritten in place is opened again
  return open_file(path, separator_token)


def given_tokenizer(path: str, separator_token: str = ''):
  """`data.tokenizer`'s tokenizer (`open_file`), opened once per file state: validating a
  config and loading its corpus share it."""
  path = os.path.abspath(os.path.expanduser(path))
  stat = os.stat(path)
  return _opened(path, separator_token, (stat.st_mtime_ns, stat.st_size, stat.st_ino))


def open_given(data_config):
  """`data.tokenizer`'s tokenizer (`data_config`: the typed data section), opened once per file
  state (`given_tokenizer`); a ConfigError naming the field when it cannot be used."""
  path = data_config.tokenizer
  try:
    return given_tokenizer(path, data_config.separator_token)
  except ValueError as e:
    raise ConfigError(f'data.tokenizer={path!r}: {e}') from None
  except OSError as e:
    raise ConfigError(f'data.tokenizer={path!r} cannot be read ({e.strerror or e}); point '
                      "data.tokenizer at a readable tokenizer file, or '' to train one") from None
