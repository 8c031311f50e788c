"""TFDS builder `wikitext103`: WikiText-103 (raw), one example per article.

From the public `wikitext-103-raw-v1.zip` (files `wiki.train.raw`, `wiki.valid.raw`,
`wiki.test.raw`), fetched with the TFDS download manager, or a local copy
(`archive=`). Articles are cut at the top-level ` = Title = ` heading lines; each
article's text keeps its heading line and every following line up to the next
top-level heading, newlines included, so the articles of a split concatenate back
to the split's file (less any blank preamble before the first heading).
"""

import os
import posixpath
import re
import zipfile

import logging
import tensorflow_datasets as tfds

from efficient_lm.data import archives
from efficient_lm.data import text_builder

log = logging.getLogger(__name__)

ARCHIVE_NAME = 'wikitext-103-raw-v1.zip'
ARCHIVE_SHA256 = '91c00ae287f0d699e18605c84afc9e45c192bc6b7797ff8837e5474655a33794'
URLS = (
    'https://wikitext.smerity.com/wikitext-103-raw-v1.zip',
    'https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-raw-v1.zip',
)
SPLIT_FILES = {'train': 'wiki.train.raw', 'validation': 'wiki.valid.raw', 'test': 'wiki.test.raw'}

# ' = Title = ' but not ' = = Section = = '.
_HEADING = re.compile(r'^ = ([^=].*?) = $')


def heading_title(line: str) -> str | None:
  """The title if `line` is a top-level article heading, else None."""
  match = _HEADING.match(line.rstrip('\r\n'))
  return match.group(1).strip() if match else None


def split_articles(lines):
  """Yields (title, text) per article from an iterable of lines (with their newlines)."""
  title, chunk = None, []
  for line in lines:
    new_title = heading_title(line)
    if new_title is not None:
      if title is not None:
        yield title, ''.join(chunk)
        chunk = []
      elif not ''.join(chunk).strip():
        chunk = []  # A blank preamble is dropped; non-blank text joins the first article.
      title = new_title
    chunk.append(line)
  text = ''.join(chunk)
  if title is not None:
    yield title, text
  elif text.strip():
    yield '', text


class Wikitext103(text_builder.ArchiveTextBuilder):
  """WikiText-103 raw (Merity et al. 2016), one example per Wikipedia article."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'wikitext-103-raw-v1, split into articles.'}

  ARCHIVE_NAME = ARCHIVE_NAME
  ARCHIVE_SHA256 = ARCHIVE_SHA256
  URLS = URLS
  HOMEPAGE = 'https://blog.salesforceairesearch.com/the-wikitext-long-term-dependency-language-modeling-dataset/'

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    archive = self._fetch_archive(os.fspath(dl_manager.download_dir))
    with zipfile.ZipFile(archive) as zf:
      members = {posixpath.basename(n): n for n in zf.namelist() if not n.endswith('/')}
    missing = [f for f in SPLIT_FILES.values() if f not in members]
    if missing:
      raise archives.DownloadError(f'{archive!r} lacks {missing}; it is not {ARCHIVE_NAME}')
    return {split: self._generate_examples(archive, members[name])
            for split, name in SPLIT_FILES.items()}

  def _generate_examples(self, archive: str, member: str):
    with zipfile.ZipFile(archive) as zf, zf.open(member) as f:
      lines = (line.decode('utf-8', errors='replace') for line in f)
      for i, (title, text) in enumerate(self._counted(split_articles(lines))):
        yield f'{i:08d}', {'text': text, 'title': title}
