"""The workdir checked first (`workdir.check_usable`): a file, an unwritable folder, a folder that is
not a workdir, a disk without room for a checkpoint: one `error:` line, status 2, before jax."""

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import REPO, build
from efficient_lm.cli import common as cli
from efficient_lm.cli import help as help_lib
from efficient_lm.state import workdir as workdir_lib
from efficient_lm.state.workdir import WorkdirError, check_usable


def train(workdir, *extra):
  start = time.perf_counter()
  done = subprocess.run([sys.executable, "-m", "efficient_lm.main", "--config=configs/pi_attention.py",
                         f"--workdir={workdir}", *extra], capture_output=True, text=True, cwd=REPO,
                        timeout=120)
  return done, time.perf_counter() - start


def one_error_line(done) -> str:
  assert done.returncode == 2, done.stderr[-2000:]
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: --workdir="), done.stderr[-2000:]
  assert done.stdout == ""
  return lines[0]


def test_a_file_answers_at_once(tmp_path):
  """The user's mistake of old (FileExistsError after 16 s): one line, well before jax would have
  started (measured about 0.8 s on the 2-core test machine; 5 s leaves room for a loaded one)."""
  path = tmp_path / "somefile"
  path.write_text("not a folder")
  done, seconds = train(path)
  assert one_error_line(done) == (f"error: --workdir={path} is a file, not a folder; give a new or "
                                  "empty folder, or a workdir a run wrote")
  assert seconds < 5, seconds
  assert path.read_text() == "not a folder"


def test_a_file_above_it(tmp_path):
  (tmp_path / "f").write_text("")
  done, _ = train(tmp_path / "f" / "run")
  assert f"cannot be made: {tmp_path / 'f'} is a file" in one_error_line(done)


@pytest.mark.parametrize("path", ["/proc/1", "/proc/efficient_lm_no_such/run"])
def test_a_folder_nothing_can_be_written_in(path):
  """Root ignores permission bits, so a chmod'ed folder would not test this as root: /proc is a
  place no one can create anything in, root included (an existing folder there fails os.access;
  a new one fails the real write probe with ENOENT), so these cases hold for every user."""
  assert os.path.isdir("/proc/1")
  done, _ = train(path)
  line = one_error_line(done)
  assert "is not writable by this user" in line or "nothing can be created in /proc" in line, line
  assert "give a folder you can write in" in line


def test_the_probe_decides_where_permission_bits_say_yes(tmp_path, monkeypatch):
  """A folder whose bits allow writing (as for root everywhere) but where creating fails (a
  read-only filesystem, a full quota) is refused by the real probe."""
  assert os.access(tmp_path, os.W_OK)

  def refuse(*args, **kwargs):
    raise PermissionError(30, "Read-only file system")

  monkeypatch.setattr(tempfile, "mkdtemp", refuse)
  with pytest.raises(WorkdirError, match=r"nothing can be created in .* \(Read-only file system\)"):
    check_usable(str(tmp_path / "run"))


def test_a_folder_that_is_not_a_workdir(tmp_path):
  for name in ("notes.txt", "data", "setup.py", "thesis.tex"):
    (tmp_path / name).write_text("mine")
  done, _ = train(tmp_path)
  line = one_error_line(done)
  assert line.startswith(f"error: --workdir={tmp_path} holds other things (data, notes.txt, "
                         "setup.py, ...) and none of a workdir's"), line
  assert f"--workdir={tmp_path / 'run'}" in line
  assert sorted(os.listdir(tmp_path)) == ["data", "notes.txt", "setup.py", "thesis.tex"]


@pytest.mark.parametrize("entries", [[], [".hidden"], ["lost+found"], ["checkpoints"],
                                     ["metrics.jsonl", "notes.txt"], ["config.json"],
                                     ["tokenizer.model"], ["checkpoints_unreadable"],
                                     ["log.txt"], ["train.log", "nohup.out"]])
def test_what_counts_as_a_workdir(tmp_path, entries):
  """Empty, only hidden entries or logs (a run's output teed into its own folder, as the
  experiments' runners do), or any of a workdir's own (with anything else beside): usable."""
  for name in entries:
    (tmp_path / name).mkdir()
  check_usable(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == sorted(entries)  # the probe left nothing behind


def test_a_disk_without_room_for_a_checkpoint(tmp_path):
  """A model far larger than any disk: refused from the config alone, nothing written."""
  done, _ = train(tmp_path / "w", "--config.model.d_model=65536", "--config.model.num_layers=1000")
  line = one_error_line(done)
  assert "one checkpoint of this model needs at least" in line and "free some space" in line, line
  assert "x 4 bytes x 3" in line
  assert not (tmp_path / "w").exists()


def test_the_room_needed_against_the_disk(tmp_path, monkeypatch):
  config = cli.load_config("pi_attention")
  params, need = workdir_lib.checkpoint_bytes_floor(build(config))
  assert need == params * 12
  usage = shutil.disk_usage(tmp_path)
  monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=need - 1))
  with pytest.raises(WorkdirError, match=f"{params:,} parameters x 4 bytes x 3"):
    check_usable(str(tmp_path / "w"), config)
  monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=need))
  check_usable(str(tmp_path / "w"), config)


@pytest.mark.parametrize("spec", sorted({spec for spec, _ in help_lib.MODELS.values()} | {"ecp:authors"}))
def test_the_floor_is_below_the_real_parameter_count(spec):
  """`checkpoint_bytes_floor` never asks for more room than the model's real checkpoint (counted
  from its parameters' shapes), and is not far below it at the shipped sizes (0.49-0.59 of it:
  the vocabulary is counted at 256 rows at most)."""
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from efficient_lm import models  # pylint: disable=import-outside-toplevel
  config = cli.load_config(spec)
  run = build(config)
  floor, _ = workdir_lib.checkpoint_bytes_floor(run)
  model = nnx.eval_shape(lambda: models.create(run.model, rngs=nnx.Rngs(0), platform="cpu"))
  real = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert floor <= real, (floor, real)
  assert floor >= 0.45 * real, (floor, real)
