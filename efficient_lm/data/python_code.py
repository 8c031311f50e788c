"""TFDS builder `python_code`: the Python source of SQLAlchemy, one example per `.py` file.

A corpus with long-range structure: names defined near the top of a module recur thousands of
tokens later. `PythonCode` fetches the `SQLAlchemy==2.1.9` sdist with `pip download` (or reads a
local copy, `archive=`), verified by sha256, and keeps each UTF-8 `.py` file that is not small,
binary-looking or generated (`decode_source`), titled by its path in the project. `assign_splits`
puts each file in exactly one split by the sha256 rank of its title (`HELD_OUT_FRACTION` each for
validation and test, at least `MIN_HELD_OUT_FILES`): a function of the set of titles only.

Details (the filters, the splits, the sizes): docs/data.md, python_code.
"""

import hashlib
import os
import re
import tarfile

import logging
import tensorflow_datasets as tfds

from efficient_lm.data import archives
from efficient_lm.data import text_builder

log = logging.getLogger(__name__)

PROJECT = 'SQLAlchemy'
PROJECT_VERSION = '2.1.9'
LICENSE = 'MIT'
PIP_REQUIREMENT = f'sqlalchemy=={PROJECT_VERSION}'
ARCHIVE_NAME = f'sqlalchemy-{PROJECT_VERSION}.tar.gz'
ARCHIVE_SIZE = 10657094  # bytes
ARCHIVE_SHA256 = 'd700a8b2edfb26282a470333d6bc4a454c4acda4d201a3bea7b72fa76c217d28'

MIN_FILE_BYTES = 1024
MAX_LINE_CHARS = 10_000
HELD_OUT_FRACTION = 0.05  # each of validation and test
MIN_HELD_OUT_FILES = 3  # each of validation and test
SPLITS = ('train', 'validation', 'test')

_SUFFIX = '.py'
_HEADER_LINES = 3  # the first non-blank lines searched for a "generated" notice
_GENERATED = re.compile(
    r'this file (?:is|was|has been) (?:\w+ )?generated|do not edit', re.IGNORECASE)


def title_of(member_name: str) -> str:
  """The path inside the project: the member's name less the sdist's top directory."""
  parts = member_name.removeprefix('./').split('/', 1)
  return parts[1] if len(parts) == 2 else parts[0]


def is_generated(text: str) -> bool:
  """Whether the first non-blank lines of a source file call it generated."""
  lines = [line for line in text.split('\n', 40)[:40] if line.strip()][:_HEADER_LINES]
  return any(_GENERATED.search(line) for line in lines)


def decode_source(raw: bytes) -> tuple[str | None, str]:
  """(the file's text (BOM dropped, CRLF/CR -> '\\n'), '') or (None, why it is skipped)."""
  if len(raw) < MIN_FILE_BYTES:
    return None, 'small'
  if b'\0' in raw:
    return None, 'binary'
  try:
    text = raw.decode('utf-8-sig')
  except UnicodeDecodeError:
    return None, 'not utf-8'
  text = text.replace('\r\n', '\n').replace('\r', '\n')
  if any(len(line) > MAX_LINE_CHARS for line in text.split('\n')):
    return None, 'long line'
  if is_generated(text):
    return None, 'generated'
  return text, ''


def read_files(archive: str) -> tuple[dict[str, str], dict[str, str]]:
  """({title: text} of the kept `.py` files, {title: why} of the skipped ones)."""
  kept, skipped = {}, {}
  with tarfile.open(archive, 'r:*') as tar:
    for member in tar:
      if not member.isfile() or not member.name.endswith(_SUFFIX):
        continue
      title = title_of(member.name)
      if title in kept or title in skipped:
        raise archives.DownloadError(f'{archive!r} holds {title!r} twice')
      text, why = decode_source(tar.extractfile(member).read())
      if text is None:
        skipped[title] = why
      else:
        kept[title] = text
  return kept, skipped


def split_rank_key(title: str) -> str:
  return hashlib.sha256(title.encode('utf-8')).hexdigest()


def assign_splits(titles) -> dict[str, list[str]]:
  """Titles per split (each sorted); each title in exactly one split."""
  ranked = sorted(set(titles), key=lambda t: (split_rank_key(t), t))
  held_out = max(MIN_HELD_OUT_FILES, round(HELD_OUT_FRACTION * len(ranked)))
  if len(ranked) < 2 * held_out + 1:  # TFDS cannot write an empty split
    raise archives.DownloadError(
        f'the archive has only {len(ranked)} usable .py files (need at least '
        f'{2 * held_out + 1}); it is not the {ARCHIVE_NAME} sdist: check data.archive')
  return {
      'train': sorted(ranked[2 * held_out:]),
      'validation': sorted(ranked[:held_out]),
      'test': sorted(ranked[held_out:2 * held_out]),
  }


class PythonCode(text_builder.ArchiveTextBuilder):
  """SQLAlchemy's Python source, one example per `.py` file, split by file (docs/data.md)."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': f'.py files of {PIP_REQUIREMENT} from the Python package index.'}

  ARCHIVE_NAME = ARCHIVE_NAME
  ARCHIVE_SIZE = ARCHIVE_SIZE
  ARCHIVE_SHA256 = ARCHIVE_SHA256
  PIP_REQUIREMENT = PIP_REQUIREMENT
  HOMEPAGE = f'https://pypi.org/project/SQLAlchemy/{PROJECT_VERSION}/'

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    archive = self._fetch_archive(os.fspath(dl_manager.download_dir))
    files, skipped = read_files(archive)
    splits = assign_splits(files)
    log.info('python_code: %s files per split, %d skipped', {k: len(v) for k, v in splits.items()},
             len(skipped))
    return {split: self._generate_examples([(t, files[t]) for t in titles])
            for split, titles in splits.items()}

  def _generate_examples(self, items):
    for title, text in items:
      yield title, {'text': text, 'title': title}
