"""Studies registered before their runs, and whether a result came after its registration.

A study is `experiments/registered/<study>.json`: its question, arms, seeds, claims (test, sides,
power), secondary measures and exact commands. Its registration is the commit that added the file
(read from git), unless the file records an earlier commit in `registered_in` (a family fixed in
code before this folder existed, recorded after the fact: `seed_level_family.json`), which must
exist and hold the claims it names.

A result is confirmatory for a study when the commit it ran from (`code` in its results row)
descends from the registration (the registration was in the tree that produced it); otherwise it
is exploratory: reported, never a verdict. A commit git does not know, or no git at all, is
"unknown", which counts as exploratory.
"""

import functools
import json
import os
import re
import subprocess

from experiments.common import REPO

REGISTERED = os.path.join(REPO, "experiments", "registered")
PREREGISTERED, EXPLORATORY = "preregistered", "exploratory"


def _git(*args: str) -> str | None:
  try:
    out = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, check=False)
  except OSError:
    return None
  return out.stdout.strip() if out.returncode == 0 else None


def studies(folder: str = REGISTERED) -> dict[str, dict]:
  """Every registered study by name (the file's `study`, which must match its file name)."""
  out = {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".json"):
      with open(os.path.join(folder, name)) as f:
        study = json.load(f)
      if study.get("study") != name[:-5]:
        raise ValueError(f"{folder}/{name}: its 'study' is {study.get('study')!r}, not {name[:-5]!r}")
      study["path"] = os.path.relpath(os.path.join(folder, name), REPO)
      out[study["study"]] = study
  return out


@functools.lru_cache(maxsize=None)
def commit_of(ref: str | None) -> str | None:
  """The full hash of a recorded code version ('2229519...', '010e34b (snapshot: ...)'), or None
  when there is none or git does not know it."""
  match = re.match(r"\s*([0-9a-f]{7,40})\b", ref or "")
  return _git("rev-parse", "--verify", "--quiet", match.group(1) + "^{commit}") if match else None


@functools.lru_cache(maxsize=None)
def registration_commit(path: str, registered_in: str | None = None) -> str | None:
  """The study's registration: `registered_in` if recorded (checked to exist), else the commit
  that added `path` (None while the file is not committed)."""
  if registered_in:
    commit = commit_of(registered_in)
    if commit is None:
      raise ValueError(f"{path}: registered_in={registered_in!r} is not a commit of this repository")
    return commit
  added = _git("log", "--diff-filter=A", "--format=%H", "--", path)
  return added.splitlines()[-1] if added else None


def study_commit(study: dict) -> str | None:
  return registration_commit(study["path"], study.get("registered_in"))


@functools.lru_cache(maxsize=None)
def ran_after(registration: str | None, code: str | None) -> bool:
  """True when the result's code descends from (or is) the registration commit."""
  commit = commit_of(code)
  if registration is None or commit is None:
    return False
  return _git("merge-base", "--is-ancestor", registration, commit) is not None


def label(study: dict, codes_by_seed: dict[int, list[str | None]]) -> dict:
  """Whether the results a claim rests on (per seed, the code of each of its runs) came after
  `study`'s registration: `status` (preregistered only when every one did), the registration
  commit, and the seeds with a run that did not."""
  registration = study_commit(study)
  before = sorted(s for s, codes in codes_by_seed.items()
                  if not all(ran_after(registration, c) for c in codes))
  return {"study": study["study"], "registered_in": registration[:7] if registration else None,
          "status": EXPLORATORY if before or not codes_by_seed else PREREGISTERED,
          "seeds_before_registration": before}
