"""Files that several processes, on one host or many, write into one shared directory.

A temporary file is named `<name>.<host>.<pid>.<random>.tmp` (`unique_suffix`): containers on
different hosts often have the same process ids, and one process must never remove or rename
another's file. Every file appears by renaming a complete temporary file into place.
"""

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
