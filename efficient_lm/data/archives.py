"""Archive checks shared by the dataset builders: sha256 verification and a clear error."""

import hashlib
import os


class DownloadError(RuntimeError):
  """A dataset archive could not be fetched, or is not the expected file."""


def sha256_of(path: str) -> str:
  """Hex sha256 of a file, read in 1 MiB chunks."""
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for chunk in iter(lambda: f.read(1 << 20), b''):
      digest.update(chunk)
  return digest.hexdigest()


def verify_sha256(path: str, expected: str, *, what: str, fix: str) -> None:
  """Raises DownloadError unless the file at `path` exists and has sha256 `expected`."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise DownloadError(f'{what} archive {path!r} does not exist; {fix}')
  actual = sha256_of(path)
  if actual != expected.lower():
    raise DownloadError(
        f'{what} archive {path!r} has sha256 {actual}, expected {expected}: it is not the '
        f'expected file (truncated download or a different release); {fix}')
