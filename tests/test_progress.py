"""Progress from the first second, and the files several processes share: the phase ticker, time
based training lines, metrics.jsonl holding each step once after a resume, unique temporary names,
evaluation token counts that every process agrees on."""

import contextlib
import json
import logging
import os
import re
import time

import numpy as np
import pytest

from conftest import build
from efficient_lm.config.data import DataConfig
from efficient_lm.runtime import files
from efficient_lm.runtime import progress
from efficient_lm.runtime import signals
from efficient_lm.training import loop as train
from efficient_lm.training import evaluate as training_evaluate
from efficient_lm.training import metrics


def test_a_phase_says_how_far_it_is_while_it_lasts(caplog):
  done = {"n": 0}
  with caplog.at_level(logging.INFO, logger="efficient_lm.runtime.progress"):
    with progress.phase("tokenizing the train split", status=lambda: f"{done['n']} documents",
                        every=0.05):
      assert signals.current_phase() == "tokenizing the train split"
      for _ in range(6):
        done["n"] += 1
        time.sleep(0.04)
    time.sleep(0.1)  # nothing after the phase
  lines = [r.getMessage() for r in caplog.records]
  assert len(lines) >= 2 and all(line.startswith("tokenizing the train split ... 0 s: ")
                                 for line in lines), lines
  assert lines[-1].endswith(("5 documents", "6 documents"))
  assert signals.current_phase() == "starting"


@contextlib.contextmanager
def bare_logging():
  """The logging of a fresh Python (a notebook kernel): no root handler (pytest's taken away
  inside the test), the library's logger untouched; everything put back afterwards."""
  root, ours = logging.getLogger(), logging.getLogger("efficient_lm")
  saved = (root.handlers[:], ours.handlers[:], ours.level, ours.propagate)
  root.handlers, ours.handlers = [], []
  ours.setLevel(logging.NOTSET)
  ours.propagate = True
  try:
    yield root, ours
  finally:
    root.handlers, ours.handlers = saved[0], saved[1]
    ours.setLevel(saved[2])
    ours.propagate = saved[3]


class _Collect(logging.Handler):
  def __init__(self, level=logging.NOTSET):
    super().__init__(level)
    self.lines = []

  def emit(self, record):
    self.lines.append(record.getMessage())


def test_a_call_from_python_shows_progress_without_any_logging_set_up(capsys):
  """Nothing set up: the first phase gives the library's logger a stderr handler (time, message),
  once; its lines reach stderr once, and a root handler added later does not double them."""
  with bare_logging() as (_, ours):
    with progress.phase("scoring 3 texts", status=lambda: "1 of 3", every=0.05):
      time.sleep(0.12)
    with progress.phase("again"):  # a second call adds nothing
      pass
    progress.show()
    assert len(ours.handlers) == 1 and isinstance(ours.handlers[0], progress.StderrHandler)
    logging.getLogger().addHandler(late := _Collect())
    logging.getLogger("efficient_lm.training.loop").info("step 1/4  loss 5.0")
    err = capsys.readouterr().err.splitlines()
    assert len(err) >= 2 and all(re.fullmatch(r"\d\d:\d\d:\d\d .+", l) for l in err), err
    assert err[0].endswith(" scoring 3 texts ... 0 s: 1 of 3") and err[-1].endswith(" step 1/4  loss 5.0")
    assert late.lines == []


def test_progress_goes_through_the_users_own_logging_once(capsys):
  with bare_logging() as (root, ours):
    root.addHandler(mine := _Collect())  # a handler of the user's (or pytest's, absl's)
    progress.show()
    logging.getLogger("efficient_lm.training.loop").info("step 2/4")
    assert mine.lines == ["step 2/4"] and ours.handlers == [] and ours.level == logging.INFO
    assert capsys.readouterr().err == ""
    # logging.basicConfig(level=logging.INFO): the root at INFO, its plain handler shows our lines.
    root.handlers = [plain := logging.StreamHandler()]
    plain.setFormatter(logging.Formatter("mine: %(message)s"))
    root.setLevel(logging.INFO)
    ours.setLevel(logging.NOTSET)
    try:
      progress.show()
      logging.getLogger("efficient_lm.training.loop").info("step 3/4")
    finally:
      root.setLevel(logging.WARNING)
    assert capsys.readouterr().err == "mine: step 3/4\n" and ours.handlers == []


def test_absls_default_root_handler_does_not_hide_or_double_progress(capsys):
  """absl's first log line (orbax logs one on import) calls logging.basicConfig(): a plain stderr
  handler on the root, left at WARNING. Our lines then come through our own handler, once."""
  with bare_logging() as (root, ours):
    logging.basicConfig()
    assert len(root.handlers) == 1 and root.level == logging.WARNING
    progress.show()
    logging.getLogger("efficient_lm.training.loop").info("step 3/4")
    logging.getLogger("efficient_lm.training.loop").warning("a warning")
    err = capsys.readouterr().err.splitlines()
    assert [l[9:] for l in err] == ["step 3/4", "a warning"], err
    assert isinstance(ours.handlers[0], progress.StderrHandler) and not ours.propagate
    # A root handler that shows warnings only: our own handler too.
    root.handlers = [quiet := _Collect(logging.WARNING)]
    ours.handlers = []
    ours.setLevel(logging.NOTSET)
    progress.show()
    logging.getLogger("efficient_lm.training.loop").info("step 4/4")
    assert capsys.readouterr().err.count("step 4/4") == 1 and quiet.lines == []


def test_a_level_the_user_set_is_kept_and_commands_are_not_doubled(capsys):
  with bare_logging() as (_, ours):
    ours.setLevel(logging.WARNING)  # the user's choice: the library quiet
    with progress.phase("quiet", every=0.02):
      time.sleep(0.06)
    assert ours.handlers == [] and capsys.readouterr().err == ""
    progress.setup_command_logging()  # what every command runs first
    progress.show()
    logging.getLogger("efficient_lm.main").info("once")
    assert len(ours.handlers) == 1 and capsys.readouterr().err.count("once") == 1


def test_a_phase_inside_a_phase_adds_its_status_to_the_outer_line(caplog):
  with caplog.at_level(logging.INFO, logger="efficient_lm.runtime.progress"):
    with progress.phase("needle grid", status=lambda: "length 160", every=0.05):
      with progress.phase("generating 4 rows", status=lambda: "decoding step 3"):
        assert signals.current_phase() == "generating 4 rows"  # what a stop names
        time.sleep(0.12)
  lines = [r.getMessage() for r in caplog.records]
  assert lines and all(l.startswith("needle grid ... 0 s: length 160") for l in lines), lines
  assert "needle grid ... 0 s: length 160; generating 4 rows: decoding step 3" in lines


def test_durations_and_sizes_read_as_a_person_would():
  assert [progress.duration(s) for s in (35, 245, 3723)] == ["35 s", "4m05s", "1h02m03s"]
  assert [progress.size(n) for n in (512, 81_000, 45_200_000, 1.3e9)] == [
      "512 bytes", "81 KB", "45.2 MB", "1.3 GB"]


@pytest.mark.slow  # a tiny training run
def test_training_reports_on_a_time_basis_too(tiny_config, tmp_path, monkeypatch, caplog):
  """With the time basis at 0 s every step logs a progress line; metrics.jsonl still gets the
  train.log_every lines only."""
  monkeypatch.setattr(train, "PROGRESS_SECONDS", 0.0)
  config = tiny_config(num_steps=12, log_every=5, eval_every=12, checkpoint_every=12,
                       sample_tokens=0)
  with caplog.at_level(logging.INFO, logger="efficient_lm.training.loop"):
    train.train_and_evaluate(build(config), str(tmp_path / "w"))
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
  assert [int(line.split()[1].split("/")[0]) for line in lines] == list(range(1, 13))
  assert all("tokens/s" in line and "ETA" in line and "loss" in line for line in lines)
  with open(tmp_path / "w" / "metrics.jsonl") as f:
    logged = [json.loads(line)["step"] for line in f if '"loss"' in line]
  assert logged == [5, 10, 12]


def test_a_resumed_run_keeps_each_step_once_in_metrics(tmp_path):
  """Lines of steps after the checkpoint a run resumes from (and a line torn by the kill) move to
  metrics.superseded.jsonl: nothing is lost, metrics.jsonl holds every step once."""
  lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (5, 10, 15, 20)]
  (tmp_path / "metrics.jsonl").write_text("".join(lines) + '{"step": 25, "lo')
  assert metrics.rewind(str(tmp_path), 10) == 3
  assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:2])
  assert (tmp_path / metrics.SUPERSEDED).read_text() == "".join(lines[2:]) + '{"step": 25, "lo\n'
  assert metrics.rewind(str(tmp_path), 10) == 0 and metrics.rewind(str(tmp_path / "no"), 1) == 0


def test_temporary_names_are_unique_per_host_process_and_call(tmp_path):
  """Containers on different hosts often share process ids: the name has the host, the process
  and a random part. The write probe leaves nothing behind."""
  import socket  # pylint: disable=import-outside-toplevel
  names = {files.unique_suffix() for _ in range(100)}
  assert len(names) == 100
  assert all(n.startswith(f"{socket.gethostname()}.{os.getpid()}.") for n in names)
  files.check_writable(str(tmp_path / "d"))
  assert os.listdir(tmp_path / "d") == []


def test_every_process_counts_the_same_evaluation_tokens(tiny_config):
  """Per global evaluation batch, the target tokens of all processes' rows: the sum of the batch's
  weights over every process's rows (the last batch padded differently on each), the whole split
  over all batches."""
  from efficient_lm import data  # pylint: disable=import-outside-toplevel
  corpus = data.load(data.validate(DataConfig.from_mapping(tiny_config().data)))
  per_process, processes = 2, 3
  batches = [list(corpus.eval_batches("validation", batch_size=per_process, process_index=i,
                                      process_count=processes)) for i in range(processes)]
  total = 0.0
  for index, rows in enumerate(zip(*batches)):
    expected = sum(float(np.sum(b["weights"])) for b in rows)
    assert training_evaluate._targets_in_batch(corpus, "validation", index, per_process * processes) == expected
    total += expected
  assert total == corpus.num_tokens("validation")
