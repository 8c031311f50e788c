"""Files that several processes, on one host or many, write into one shared directory.

A temporary file is named `<name>.<host>.<pid>.<random>.tmp` (`unique_suffix`): containers on
different hosts often have the same process ids, and one process must never remove or rename
another's file. Every file appears by renaming a complete temporary file into place.
"""

import hashlib
import os
import secrets
import socket


def unique_suffix() -> str:
  """`<host>.<pid>.<random>`: no other process, here or on another host, has it."""
  return f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"


def check_writable(directory: str) -> None:
  """Creates `directory` and writes, then removes, a probe file of this process's own name in it;
  OSError if it cannot."""
  os.makedirs(directory, exist_ok=True)
  probe = os.path.join(directory, f".write_test.{unique_suffix()}")
  try:
    with open(probe, "w") as f:
      f.write("ok")
  finally:
    if os.path.exists(probe):
      os.remove(probe)


def sha256_of(path: str) -> str:
  """Hex sha256 of a file, read in 1 MiB chunks (an archive's, a tokenizer's: a run's records)."""
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for chunk in iter(lambda: f.read(1 << 20), b''):
      digest.update(chunk)
  return digest.hexdigest()
