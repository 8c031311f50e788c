"""A workdir resumes from its own files, anywhere: the library's tokenizer training gives the same
bytes in any folder on any number of cores; a resumed run tokenizes with the workdir's tokenizer
under any data.data_dir (an empty one, another machine's); `python -m efficient_lm.main
--workdir=W` alone continues W from its config.json, overrides on top."""

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, SHAKESPEARE_WORKS, fake_work_text, subprocess_env
from efficient_lm.cli import resume_file
from efficient_lm.config import base as config_base
from efficient_lm.config.data import DataConfig
from efficient_lm.data import tokenizer as tok
from efficient_lm.state import workdir as workdir_lib


def sha256(path) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def texts() -> list[str]:
  """A corpus big enough for the trainer's per-thread sums to round differently."""
  return [fake_work_text(f"{work}{i}", 300) for i in range(12) for work in SHAKESPEARE_WORKS]


_TRAIN = """
import os, sys
sys.path.insert(0, {tests!r})
from conftest import SHAKESPEARE_WORKS, fake_work_text
from efficient_lm.data import tokenizer as tok
os.cpu_count = lambda: {cores}
texts = [fake_work_text(f"{{work}}{{i}}", 300) for i in range(12) for work in SHAKESPEARE_WORKS]
tok.Tokenizer.train(texts, vocab_size=380, model_path={path!r})
"""


def test_the_library_tokenizer_is_the_same_bytes_in_any_folder_on_any_number_of_cores(
    tmp_path, monkeypatch):
  """Trained twice, in two folders, by two processes that see 1 and 8 cores: byte-identical (the
  trainer once recorded its temporary folder in the model and split its sums by the core count)."""
  monkeypatch.setattr(os, "cpu_count", lambda: 1)
  here = tok.Tokenizer.train(texts(), vocab_size=380, model_path=str(tmp_path / "a" / "spm.model"))
  there = str(tmp_path / "b" / "elsewhere" / "spm.model")
  done = subprocess.run([sys.executable, "-c", _TRAIN.format(
      tests=os.path.join(REPO, "tests"), cores=8, path=there)], capture_output=True, text=True,
                        cwd=str(tmp_path), env=subprocess_env(), timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert here.vocab_size == 380
  assert sha256(here.model_path) == sha256(there)
  assert sorted(os.listdir(tmp_path / "a")) == ["spm.model"]  # nothing else left beside it


def fake_workdir(path, *, asked_vocab: int, trained_vocab: int) -> workdir_lib.Workdir:
  """A workdir as a run on a small corpus leaves it: config.json holds the tokenizer's size,
  data.json the vocabulary the run asked for; one checkpoint folder."""
  config = config_base.base_config("dense")
  config.data.vocab_size = trained_vocab
  os.makedirs(path / "checkpoints" / "10")
  (path / "config.json").write_text(config.to_json_best_effort())
  settings = dict(workdir_lib.corpus_settings(DataConfig.from_mapping(config.data)),
                  vocab_size=asked_vocab)
  (path / "data.json").write_text(json.dumps({"dataset": "shakespeare", "settings": settings}))
  return workdir_lib.Workdir(str(path))


def test_the_resume_config_is_the_run_as_asked_with_overrides_following(tmp_path):
  config = resume_file.get_config(fake_workdir(tmp_path, asked_vocab=384, trained_vocab=323).path)
  assert config.data.vocab_size == 384  # as asked: a small corpus's tokenizer sets the model's
  config.lock()
  config.data.vocab_size, config.data.seq_len = 512, 64  # an override, as --config.data.x=y
  assert (config.model.vocab_size, config.model.seq_len) == (512, 64)  # follow, as in a file


def test_the_workdir_tokenizer_is_used_only_to_resume_the_corpus_it_was_trained_on(tmp_path):
  wd = fake_workdir(tmp_path, asked_vocab=384, trained_vocab=323)
  data_config = resume_file.get_config(wd.path).data
  typed = DataConfig.from_mapping(data_config)  # (the data section the run is built with)
  assert wd.resume_tokenizer(typed) == ""  # no tokenizer file in it
  tok.Tokenizer.train(texts()[:4], vocab_size=320, model_path=str(tmp_path / "tokenizer.model"))
  assert wd.resume_tokenizer(typed) == str(tmp_path / "tokenizer.model")
  other = dataclasses.replace(typed, vocab_size=1024)
  assert wd.resume_tokenizer(other) == ""  # another tokenizer asked for: the config's
  record = json.loads((tmp_path / "data.json").read_text())
  (tmp_path / "data.json").write_text(json.dumps(dict(record, tokenizer_sha256="0" * 64)))
  assert wd.resume_tokenizer(typed) == ""  # not the file data.json records: the checks answer
  shutil.rmtree(tmp_path / "checkpoints")
  assert wd.resume_tokenizer(typed) == ""  # nothing to resume


def run_main(*args, timeout=600) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "efficient_lm.main", *args], capture_output=True,
                        text=True, cwd=REPO, env=subprocess_env(), timeout=timeout)


def test_without_config_a_workdir_alone_is_needed_and_must_hold_a_run(tmp_path):
  """Each mistake is one line, status 2, before jax starts; an override is checked against the
  workdir's config as against a config file."""
  empty, run = tmp_path / "empty", tmp_path / "run"
  empty.mkdir()
  fake_workdir(run, asked_vocab=384, trained_vocab=323)
  for args, message in (([], "error: --config is missing: give a config file or a shipped config"),
                        ([f"--workdir={empty}"], f"error: --workdir={empty} has no config.json: "
                         "there is no run to continue; give --config="),
                        ([f"--workdir={run}", "--config.train.num_step=5"],
                         "error: --config.train.num_step is not a config field; did you mean "
                         "train.num_steps")):
    done = run_main(*args)
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith(message), done.stderr
  assert os.listdir(empty) == []


def plant_tokenizer(data_config) -> str:
  """Replaces the tokenizer `data_config`'s cache holds with another one (as a cache filled by an
  older trainer, another platform or another sentencepiece may hold), so that a workdir trained
  there has a tokenizer no fresh cache would train. Returns its sha256."""
  from efficient_lm import data  # pylint: disable=import-outside-toplevel
  cached = data.load(data.validate(DataConfig.from_mapping(data_config))).tokenizer.model_path
  planted = tok.Tokenizer.train(texts()[:6], vocab_size=data_config.vocab_size,
                                model_path=cached + ".planted")
  assert sha256(planted.model_path) != sha256(cached)
  os.replace(planted.model_path, cached)
  return sha256(cached)


def final_eval_loss(workdir) -> float:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if "eval_loss" in line][-1]["eval_loss"]


@pytest.mark.slow  # three training runs in subprocesses, two evaluations: ~2 min
def test_a_workdir_resumes_under_an_empty_data_dir_with_workdir_alone(
    tmp_path, tiny_config, tiny_cli_args):
  """Trained under data_dir A (whose cache holds a tokenizer no fresh cache would train), stopped
  after checkpoint 10, resumed with `--workdir` alone under an empty data_dir B: it trains on its
  own tokenizer and ends on the eval loss of the run that was never stopped. Evaluating it after
  B is cleared scores what evaluating the never-stopped run does."""
  data_a, data_b = tmp_path / "data_a", tmp_path / "data_b"
  config = tiny_config()
  config.data.data_dir = str(data_a)
  planted = plant_tokenizer(config.data)
  never_stopped, stopped = str(tmp_path / "never_stopped"), str(tmp_path / "stopped")
  args = tiny_cli_args(never_stopped, num_steps=20, eval_every=10, checkpoint_every=10,
                       sample_tokens=0) + [f"--config.data.data_dir={data_a}"]
  done = run_main(*args)
  assert done.returncode == 0, done.stderr[-3000:]
  assert sha256(os.path.join(never_stopped, "tokenizer.model")) == planted
  shutil.copytree(never_stopped, stopped)  # the same run, stopped after its checkpoint 10
  shutil.rmtree(os.path.join(stopped, "checkpoints", "20"))
  before = {name: sha256(os.path.join(stopped, name)) for name in ("config.json", "data.json")}
  for override, message in (("--config.data.vocab_size=1024", "was trained on another tokenizer"),
                            ("--config.model.d_model=64", "holds checkpoints of another model")):
    done = run_main(f"--workdir={stopped}", f"--config.data.data_dir={data_b}", override)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and message in errors[0], done.stderr[-2000:]
  assert before == {name: sha256(os.path.join(stopped, name)) for name in before}
  done = run_main(f"--workdir={stopped}", f"--config.data.data_dir={data_b}")
  assert done.returncode == 0, done.stderr[-3000:]
  assert "resumed from" in done.stderr and "at step 10" in done.stderr
  assert final_eval_loss(stopped) == pytest.approx(final_eval_loss(never_stopped), abs=1e-6)
  assert json.loads(done.stdout.strip().splitlines()[-1])["step"] == 20
  assert not (data_b / "tokenizers").exists()  # no tokenizer trained: the workdir's was used
  assert sha256(os.path.join(stopped, "tokenizer.model")) == planted
  saved = json.load(open(os.path.join(stopped, "config.json")))
  assert saved["data"]["data_dir"] == str(data_b) and saved["train"]["num_steps"] == 20
  # Evaluation reads the workdir's tokenizer too: after its cache is cleared, the same scores.
  from efficient_lm.evaluation import scoring  # pylint: disable=import-outside-toplevel
  shutil.rmtree(data_b)
  scores = [scoring.evaluate_workdir(w, max_tokens=2048)["loss"] for w in (stopped, never_stopped)]
  assert scores[0] == pytest.approx(scores[1], abs=1e-6)
  assert not (data_b / "tokenizers").exists()
