"""The base of the built-in TFDS builders: one text document per example, read from an archive."""

import os

import tensorflow_datasets as tfds

from efficient_lm import progress


class Reporting:
  """A TFDS builder mixin: while it prepares, a progress line every 20 s says how many documents it
  has written (counted as `_generate_examples` passes them through `_counted`)."""

  _documents_written = 0

  def _counted(self, examples):
    for example in examples:
      self._documents_written += 1
      yield example

  def _download_and_prepare(self, dl_manager, download_config=None):  # pylint: disable=arguments-renamed
    with progress.phase(f"preparing {self.name} (TFDS, ArrayRecord)",
                        status=lambda: f"{self._documents_written:,} documents written"):
      return super()._download_and_prepare(dl_manager, download_config)


class ArchiveTextBuilder(Reporting, tfds.core.GeneratorBasedBuilder, skip_registration=True):
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
