"""The base of the built-in TFDS builders: one text document per example, read from an archive."""

import os

import tensorflow_datasets as tfds


class ArchiveTextBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Features `{'text', 'title'}`; the archive is a local copy (`archive=`) or downloaded.

  Subclasses set `ARCHIVE_SHA256` (the official archive's) and `HOMEPAGE`.
  """

  ARCHIVE_SHA256 = ''
  HOMEPAGE = ''

  def __init__(self, *, archive: str = '', archive_sha256: str = '', **kwargs):
    """`archive`: a local copy ('' = download); `archive_sha256`: '' = the official one."""
    self._archive = os.path.expanduser(archive) if archive else ''
    self._archive_sha256 = archive_sha256 or self.ARCHIVE_SHA256
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({
            'text': tfds.features.Text(),
            'title': tfds.features.Text(),
        }),
        homepage=self.HOMEPAGE,
    )
