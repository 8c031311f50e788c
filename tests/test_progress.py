"""Progress from the first second, and the files several processes share: the phase ticker, time
based training lines, metrics.jsonl holding each step once after a resume, unique temporary names,
evaluation token counts that every process agrees on."""

import json
import logging
import os
import time

import numpy as np
import pytest

from efficient_lm import files
from efficient_lm import metrics
from efficient_lm import progress
from efficient_lm import signals
from efficient_lm import train


def test_a_phase_says_how_far_it_is_while_it_lasts(caplog):
  done = {"n": 0}
  with caplog.at_level(logging.INFO, logger="efficient_lm.progress"):
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
  with caplog.at_level(logging.INFO, logger="efficient_lm.train"):
    train.train_and_evaluate(config, str(tmp_path / "w"))
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
  corpus = data.load(data.validate(tiny_config().data))
  per_process, processes = 2, 3
  batches = [list(corpus.eval_batches("validation", batch_size=per_process, process_index=i,
                                      process_count=processes)) for i in range(processes)]
  total = 0.0
  for index, rows in enumerate(zip(*batches)):
    expected = sum(float(np.sum(b["weights"])) for b in rows)
    assert train._targets_in_batch(corpus, "validation", index, per_process * processes) == expected
    total += expected
  assert total == corpus.num_tokens("validation")
