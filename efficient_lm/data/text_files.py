"""`data.dataset='text:<glob>'`: your own folder of text files as a TFDS dataset.

    --config.data.dataset='text:~/notes/**/*.txt'    # `~` expanded, `**` any depth

`scan` globs, checks and reads every matched file, writing nothing (a ConfigError if nothing
matches, a DataError if no file is usable text), and returns a `Scan` with its cache key;
`make_builder` gives the `TextFiles` builder, one document per file (features `text`, `title`),
stored in `<data.data_dir>/tfds/text/<cache_key>/`. Splits `train`, `validation`, `test`: by file
with 3 or more usable files (`assign_files`, by sha256 rank of the relative path), else by bytes
within each file (`cut_text`); a split of fraction 0 is not written.
Details: docs/data.md, "Your own files".
"""

import dataclasses
import glob
import hashlib
import json
import logging
import os

import numpy as np
import tensorflow_datasets as tfds

from efficient_lm.data import text_builder
from efficient_lm.data.held_out import HELD_OUT, held_out_counts  # in file order: train | validation | test
from efficient_lm.data.errors import DataError
from efficient_lm.data.registry import TEXT_PREFIX
from efficient_lm.config.errors import ConfigError

log = logging.getLogger(__name__)

BINARY_SNIFF_BYTES = 8192  # a NUL byte in this many leading bytes marks a file binary
MIN_FILES_TO_SPLIT_BY_FILE = 3
_KEY_FORMAT = 1  # bump when what a key covers, or the way files are read or split, changes
_WILDCARDS = '*?['


@dataclasses.dataclass(frozen=True)
class TextFile:
  path: str      # absolute
  relpath: str   # '/'-separated, relative to the pattern's root
  size: int      # bytes on disk
  mtime_ns: int


@dataclasses.dataclass(frozen=True)
class Scan:
  """The checked files of a `text:` dataset: what `TextFiles` prepares, and its cache key."""
  dataset: str
  root: str
  files: tuple[TextFile, ...]  # the usable ones, sorted by relpath
  num_matched: int
  num_binary: int
  num_empty: int
  num_repaired: int            # usable files with invalid UTF-8 (replaced by U+FFFD)
  validation_fraction: float
  test_fraction: float
  cache_key: str
  read: bool = True            # False: listed only (files = every match, counts 0): `scan(read=False)`

  @property
  def by_bytes(self) -> bool:
    """Whether the splits are cut inside the files (too few files to split by file)."""
    return len(self.files) < MIN_FILES_TO_SPLIT_BY_FILE

  def fractions(self) -> dict[str, float]:
    """The keyword arguments of assign_files and cut_text."""
    return {'validation_fraction': self.validation_fraction, 'test_fraction': self.test_fraction}

  def split_files(self) -> dict[str, list[TextFile]]:
    """Files per split (by-file mode; docs/data.md); splits of fraction 0 omitted."""
    by_relpath = {f.relpath: f for f in self.files}
    return {split: [by_relpath[r] for r in relpaths]
            for split, relpaths in assign_files(list(by_relpath), **self.fractions()).items()}


def pattern_of(dataset: str) -> str:
  """The glob of 'text:<glob>', `~` expanded."""
  return os.path.expanduser(dataset[len(TEXT_PREFIX):].strip())


def glob_root(pattern: str) -> str:
  """The absolute directory the pattern's leading wildcard-free components name."""
  parts = pattern.split(os.sep)
  fixed = []
  for part in parts[:-1]:
    if any(c in part for c in _WILDCARDS):
      break
    fixed.append(part)
  root = os.sep.join(fixed)
  if not root:
    root = os.sep if os.path.isabs(pattern) else os.curdir
  return os.path.abspath(root)


def match_files(pattern: str) -> list[str]:
  """Sorted absolute paths of the regular files the glob matches (`**` recursive)."""
  paths = {os.path.abspath(p) for p in glob.glob(pattern, recursive=True)}
  return sorted(p for p in paths if os.path.isfile(p))


def _rank(relpath: str) -> tuple[str, str]:
  return hashlib.sha256(relpath.encode('utf-8')).hexdigest(), relpath


def assign_files(relpaths: list[str], *, validation_fraction: float,
                 test_fraction: float) -> dict[str, list[str]]:
  """Relative paths per split, by sha256 rank (docs/data.md); each list sorted."""
  ranked = sorted(relpaths, key=_rank)
  counts = held_out_counts(len(ranked), {'validation': validation_fraction, 'test': test_fraction})
  splits, start = {}, 0
  for split in HELD_OUT:
    if counts[split]:
      splits[split] = sorted(ranked[start:start + counts[split]])
    start += counts[split]
  return {'train': sorted(ranked[start:]), **splits}


def cut_text(text: str, *, validation_fraction: float, test_fraction: float) -> dict[str, str]:
  """One file's text as {'train': head, 'validation': middle, 'test': tail} (by-bytes mode).

  The tail holds about the last `test_fraction` of the UTF-8 bytes, the middle the
  `validation_fraction` before it; each cut is the line start nearest its target (a
  character boundary when there are too few lines), and no piece is empty. Splits of
  fraction 0 are omitted. The pieces concatenate back to `text`.
  """
  held = [(s, f) for s, f in zip(HELD_OUT, (validation_fraction, test_fraction)) if f > 0]
  if not held:
    return {'train': text}
  raw = text.encode('utf-8')
  size = len(raw)
  byte_values = np.frombuffer(raw, dtype=np.uint8)
  candidates = np.flatnonzero(byte_values[:-1] == ord('\n')) + 1  # line starts after the first
  if len(candidates) < len(held):  # too few lines: any character start after the first
    candidates = np.flatnonzero((byte_values[1:] & 0xC0) != 0x80) + 1
  if len(candidates) < len(held):
    raise DataError(f'a text of {len(text)} characters cannot be cut into train and {len(held)} '
                    'held-out piece(s); add text to the file')
  targets, rest = [], 1.0
  for _, f in reversed(held):  # each held-out piece starts where the later pieces' shares begin
    rest -= f
    targets.append(size * rest)
  targets.reverse()
  cuts = [0] * len(held)
  upper = len(candidates) - 1
  for j in reversed(range(len(held))):
    i = int(np.searchsorted(candidates, targets[j]))
    if i > 0 and (i == len(candidates) or targets[j] - candidates[i - 1] <= candidates[i] - targets[j]):
      i -= 1
    cuts[j] = min(max(i, j), upper)
    upper = cuts[j] - 1
  bounds = [0] + [int(candidates[i]) for i in cuts] + [size]
  names = ['train'] + [s for s, _ in held]
  return {name: raw[a:b].decode('utf-8') for name, a, b in zip(names, bounds[:-1], bounds[1:])}


def decode(raw: bytes) -> tuple[str, bool]:
  """(text, repaired): UTF-8 with U+FFFD for invalid bytes, '\\n' line ends, no leading BOM."""
  try:
    text, repaired = raw.decode('utf-8'), False
  except UnicodeDecodeError:
    text, repaired = raw.decode('utf-8', errors='replace'), True
  return text.removeprefix('\ufeff').replace('\r\n', '\n').replace('\r', '\n'), repaired


def read_text(path: str) -> tuple[str, bool]:
  """decode() of the file's bytes; a DataError naming the file if it cannot be read."""
  try:
    with open(path, 'rb') as f:
      return decode(f.read())
  except OSError as e:
    raise DataError(f'cannot read {path} ({e.strerror or e}); fix its permissions or narrow '
                    'data.dataset') from e


def _cache_key(matched: list[TextFile], validation_fraction: float, test_fraction: float) -> str:
  """What a prepared copy of the files is filed under: every matched file's path, size and mtime
  and the split fractions (no content: a listing gives it)."""
  return hashlib.sha256(json.dumps({
      'format': _KEY_FORMAT,
      'files': [[f.path, f.size, f.mtime_ns] for f in matched],
      'validation_fraction': float(validation_fraction),
      'test_fraction': float(test_fraction),
  }).encode()).hexdigest()[:16]


def _stat(path: str, root: str) -> TextFile:
  try:
    st = os.stat(path)
  except OSError as e:
    raise DataError(f'cannot read {path} ({e.strerror or e}); fix it or narrow data.dataset') from e
  return TextFile(path, os.path.relpath(path, root).replace(os.sep, '/'), st.st_size, st.st_mtime_ns)


def scan(dataset: str, validation_fraction: float, test_fraction: float, *,
         read: bool = True) -> Scan:
  """Globs, stats and reads every matched file; writes nothing.

  Raises ConfigError if the glob matches no file, DataError if no file is usable text
  (all binary or empty) or one cannot be read. Logs the skipped / repaired counts, and a
  warning when there are too few files to split by file. `read=False` lists and stats the files
  without reading them: the same cache key, enough to find what process 0 prepared (the builder
  reads them all if it has to prepare them itself).
  """
  pattern = pattern_of(dataset)
  root = glob_root(pattern)
  paths = match_files(pattern)
  if not paths:
    raise ConfigError(f'data.dataset={dataset!r} matches no file (glob {pattern!r}, looked under '
                      f'{root}); fix the pattern: `**` matches any depth (e.g. '
                      "'text:~/notes/**/*.txt'), hidden files are never matched")
  if not read:
    matched = [_stat(path, root) for path in paths]
    return Scan(dataset=dataset, root=root, files=tuple(sorted(matched, key=lambda f: f.relpath)),
                num_matched=len(paths), num_binary=0, num_empty=0, num_repaired=0,
                validation_fraction=float(validation_fraction), test_fraction=float(test_fraction),
                cache_key=_cache_key(matched, validation_fraction, test_fraction), read=False)
  matched, usable, num_chars = [], [], {}
  num_binary = num_empty = num_repaired = 0
  for path in paths:
    entry = _stat(path, root)
    matched.append(entry)
    try:
      with open(path, 'rb') as f:
        head = f.read(BINARY_SNIFF_BYTES)
        if b'\0' in head:
          num_binary += 1
          continue
        raw = head + f.read()
    except OSError as e:
      raise DataError(f'cannot read {path} ({e.strerror or e}); fix its permissions or narrow '
                      'data.dataset') from e
    text, repaired = decode(raw)
    if not text:
      num_empty += 1
      continue
    num_repaired += repaired
    usable.append(entry)
    num_chars[path] = len(text)
  counts = (f'{dataset}: {len(usable)} text file(s) of {len(paths)} matched; skipped {num_binary} '
            f'binary and {num_empty} empty; repaired {num_repaired} with invalid UTF-8 (now U+FFFD)')
  (log.warning if num_binary or num_empty or num_repaired else log.info)(counts)
  if not usable:
    raise DataError(f'data.dataset={dataset!r} matched {len(paths)} file(s) but none is usable text '
                    f'({num_binary} binary, {num_empty} empty); point data.dataset at UTF-8 text files')
  key = _cache_key(matched, validation_fraction, test_fraction)
  result = Scan(dataset=dataset, root=root, files=tuple(sorted(usable, key=lambda f: f.relpath)),
                num_matched=len(paths), num_binary=num_binary, num_empty=num_empty,
                num_repaired=num_repaired, validation_fraction=float(validation_fraction),
                test_fraction=float(test_fraction), cache_key=key)
  if result.by_bytes:
    num_held_out = sum(f > 0 for f in (validation_fraction, test_fraction))
    for f in result.files:
      if num_chars[f.path] <= num_held_out:  # cut_text needs a character per piece
        raise DataError(f'{f.path} ({num_chars[f.path]} character(s)) is too short to split into '
                        f'train and {num_held_out} held-out piece(s); add text, or add files '
                        f'to data.dataset={dataset!r} ({MIN_FILES_TO_SPLIT_BY_FILE} or more are split '
                        'by file)')
    log.warning('%s: only %d usable file(s), too few to split by file: each is split by bytes '
                '(the last %g%% test, the %g%% before it validation, the rest train, cut at line '
                'boundaries); give it %d or more files to split by file', dataset, len(usable),
                100 * test_fraction, 100 * validation_fraction, MIN_FILES_TO_SPLIT_BY_FILE)
  return result


class TextFiles(text_builder.CheckedTextBuilder, skip_registration=True):
  """The files of one `Scan`, one example per file (or per file piece, in by-bytes mode)."""

  RELEASE_NOTES = {'1.0.0': 'Text files matched by a glob, split by file or by bytes.'}
  SUBDIR = 'text'

  @property
  def _scan(self) -> Scan:
    return self._checked

  def _text_features(self) -> tuple[str, ...]:
    return ('text', 'title')

  def _description(self) -> str:
    return f'{self._scan.dataset} (the files under {self._scan.root})'

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    del dl_manager  # the files are local
    if not self._scan.read:  # listed only (another process's check): read them now
      self._checked = scan(self._scan.dataset, self._scan.validation_fraction,
                           self._scan.test_fraction)
    if not self._scan.by_bytes:
      split_files = self._scan.split_files()
      log.info('%s: files per split %s', self._scan.dataset, {s: len(f) for s, f in split_files.items()})
      return {split: self._generate_examples(files) for split, files in split_files.items()}
    pieces = {}
    for f in self._scan.files:
      text, _ = read_text(f.path)
      for split, piece in cut_text(text, **self._scan.fractions()).items():
        pieces.setdefault(split, []).append((f.relpath, piece))
    return {split: self._generate_examples(items) for split, items in pieces.items()}

  def _generate_examples(self, documents):
    """`documents`: TextFile entries (read here, one at a time) or (title, text) pairs."""
    for doc in self._counted(documents):
      title, text = (doc.relpath, read_text(doc.path)[0]) if isinstance(doc, TextFile) else doc
      yield title, {'text': text, 'title': title}


def preflight(data_config, read: bool, base_preflight=None) -> Scan:
  """The registry's checks of a `text:` dataset (`data_config`: the typed data section): `scan`."""
  del base_preflight
  return scan(data_config.dataset, data_config.validation_fraction, data_config.test_fraction,
              read=read)


def make_builder(text_scan: Scan, tfds_dir: str, data_config=None) -> TextFiles:
  """The (unprepared or prepared) builder of `text_scan`, under tfds_dir/text/<cache_key> (the
  registry's hook: `data_config` is in `text_scan`)."""
  del data_config
  return TextFiles.under(text_scan, tfds_dir)
