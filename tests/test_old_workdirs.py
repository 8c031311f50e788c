"""Workdirs written by the library before its configs were typed (commit 942e7a2, the last one
whose models read the untyped ConfigDict) resume and sample with today's code: π, BCMT and ECP.
A workdir of the library before its tokenizer training was deterministic (6d1230e) resumes under an
empty data.data_dir, as on a fresh machine, with `--workdir` alone.

The old library is taken from this repository's own history (`git archive`), run as it was, then
today's `efficient_lm.main` continues its checkpoints and `efficient_lm.sample` decodes from them.
"""

import json
import os
import subprocess
import sys
import tarfile
import io

import pytest

from conftest import REPO, TINY, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("old_workdirs")]

BEFORE_TYPED = "942e7a2"  # the library before the typed configs (issue 50)
# The library before its tokenizer training was deterministic and a resume used the workdir's
# tokenizer (issue 60): a fresh cache trained another tokenizer than the workdir holds.
BEFORE_OWN_TOKENIZER = "6d1230e"
# A subset on purpose, not the registry: one family per kind of cache and config the typing changed
# (a window with skips, blocks with a memory, pieces), each a training run of the old library; a
# family added later has no workdir of that library to resume.
FAMILIES = {
    "pi_attention": {"model.window": 8, "model.period": 8, "model.num_skips": 2},
    "bcmt": {"model.block_size": 8},
    "ecp": {"model.num_segments": 4},
}


def library_at(commit: str, tmp_path_factory) -> str:
  """The library's files at `commit`, unpacked from git."""
  archive = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", commit],
                           capture_output=True, check=False)
  assert archive.returncode == 0, (
      f"git archive {commit} failed (this test needs the repository's history): "
      f"{archive.stderr.decode()[-500:]}")
  folder = tmp_path_factory.mktemp(f"library_{commit}")
  with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
    tar.extractall(folder, filter="data")
  return str(folder)


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory):
  """The library's files at BEFORE_TYPED."""
  return library_at(BEFORE_TYPED, tmp_path_factory)


def _args(family, workdir, archive, data_dir, num_steps):
  args = [f"--config=configs/{family}.py", f"--workdir={workdir}"]
  fields = {**{f"data.{k}": v for k, v in TINY["data"].items()},
            "data.data_dir": data_dir, "data.archive": archive[0], "data.archive_sha256": archive[1],
            **{f"model.{k}": v for k, v in TINY["model"].items()},
            **{f"mesh.{k}": v for k, v in TINY["mesh"].items()},
            "train.num_steps": num_steps, "train.checkpoint_every": 2, "train.eval_every": 100,
            "train.log_every": 2, "train.sample_tokens": 0, "train.warmup_steps": 1,
            **FAMILIES.get(family, {})}
  return args + [f"--config.{k}={v}" for k, v in fields.items()]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_old_workdir_resumes_and_samples(family, old_tree, tmp_path, shakespeare_archive,
                                            tiny_data_dir):
  workdir = str(tmp_path / family)
  old = subprocess.run([sys.executable, "-m", "efficient_lm.main",
                        *_args(family, workdir, shakespeare_archive, tiny_data_dir, 2)],
                       cwd=old_tree, env=subprocess_env(PYTHONPATH=old_tree), capture_output=True,
                       text=True, timeout=600)
  assert old.returncode == 0, old.stderr[-3000:]
  saved = json.load(open(os.path.join(workdir, "config.json")))
  assert saved["model"]["name"] == family
  # Today's library: the same command continues the checkpoints to step 4.
  new = subprocess.run([sys.executable, "-m", "efficient_lm.main",
                        *_args(family, workdir, shakespeare_archive, tiny_data_dir, 4)],
                       cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
  assert new.returncode == 0, new.stderr[-3000:]
  steps = [json.loads(line).get("step") for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert 2 in steps and max(steps) == 4, steps
  assert "resum" in new.stderr.lower(), new.stderr[-2000:]
  sample = subprocess.run([sys.executable, "-m", "efficient_lm.sample", f"--workdir={workdir}",
                           "--prompt=ROMEO:", "--max_new_tokens=6", "--temperature=0", "--json"],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=600)
  assert sample.returncode == 0, sample.stderr[-3000:]
  line = json.loads(sample.stdout.strip().splitlines()[-1])
  assert line["text"].startswith("ROMEO:") and len(line["text"]) > len("ROMEO:")


def test_a_workdir_of_the_landed_library_resumes_on_a_fresh_machine(tmp_path_factory, tmp_path,
                                                                    shakespeare_archive):
  """Its tokenizer.model came from the trainer that wrote other bytes on every run: under an empty
  data.data_dir the run continues on that file (no tokenizer is trained), from its config.json."""
  tree = library_at(BEFORE_OWN_TOKENIZER, tmp_path_factory)
  workdir, fresh = str(tmp_path / "dense"), tmp_path / "fresh_data"
  old = subprocess.run([sys.executable, "-m", "efficient_lm.main",
                        *_args("dense", workdir, shakespeare_archive, str(tmp_path / "old_data"), 2)],
                       cwd=tree, env=subprocess_env(PYTHONPATH=tree), capture_output=True,
                       text=True, timeout=600)
  assert old.returncode == 0, old.stderr[-3000:]
  tokenizer = open(os.path.join(workdir, "tokenizer.model"), "rb").read()
  new = subprocess.run([sys.executable, "-m", "efficient_lm.main", f"--workdir={workdir}",
                        f"--config.data.data_dir={fresh}", "--config.train.num_steps=4"],
                       cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
  assert new.returncode == 0, new.stderr[-3000:]
  assert "resumed from" in new.stderr and "at step 2" in new.stderr, new.stderr[-2000:]
  assert json.loads(new.stdout.strip().splitlines()[-1])["step"] == 4
  assert not (fresh / "tokenizers").exists()  # the workdir's tokenizer, none trained
  assert open(os.path.join(workdir, "tokenizer.model"), "rb").read() == tokenizer
