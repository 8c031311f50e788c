"""A workdir nothing can damage: refused runs leave it byte-identical, another corpus is refused,
a small corpus's tokenizer sets the vocabulary (and sampling never asks for a missing piece)."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, build
from efficient_lm.config.data import DataConfig
from efficient_lm.config.errors import ConfigError
from efficient_lm.data import archives
from efficient_lm.evaluation import scoring
from efficient_lm.inference import generation
from efficient_lm.inference import restore as restore_lib
from efficient_lm.state import workdir as workdir_lib
from efficient_lm.training import loop as train


def snapshot(path) -> dict[str, str]:
  """sha256 of every file under `path` (the workdir, checkpoints included)."""
  out = {}
  for root, _, files in os.walk(path):
    for name in files:
      full = os.path.join(root, name)
      with open(full, "rb") as f:
        out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
  return out


@pytest.fixture
def trained(tiny_config, tmp_path_factory, _cache={}):
  """A 10-step tiny dense workdir, shared (tests copy it before changing anything)."""
  if not _cache:
    workdir = str(tmp_path_factory.mktemp("trained"))
    train.train_and_evaluate(build(tiny_config(num_steps=10, eval_every=10, checkpoint_every=10,
                                               sample_tokens=0)), workdir)
    _cache["workdir"] = workdir
  return _cache["workdir"]


def copy_of(workdir, tmp_path) -> str:
  import shutil  # pylint: disable=import-outside-toplevel
  target = str(tmp_path / "copy")
  shutil.copytree(workdir, target)
  return target


def test_the_workdir_records_config_tokenizer_and_corpus(trained):
  names = set(os.listdir(trained))
  assert {"config.json", "tokenizer.model", "data.json", "checkpoints", "metrics.jsonl"} <= names
  identity = json.load(open(os.path.join(trained, "data.json")))
  assert identity["dataset"] == "shakespeare" and identity["vocab_size"] == 384
  assert identity["tokenizer_sha256"] == archives.sha256_of(
      os.path.join(trained, "tokenizer.model"))


def test_before_start_the_settings_are_read_from_the_typed_data_section(tiny_config, tmp_path):
  """`check_before_start` types config.data (`DataConfig.from_mapping`) and compares its
  corpus-deciding fields with data.json's: a bad field is the section's own ConfigError."""
  (tmp_path / "checkpoints" / "1").mkdir(parents=True)
  (tmp_path / "data.json").write_text(json.dumps({"settings": {"dataset": "wikitext103"}}))
  wd, config = workdir_lib.Workdir(str(tmp_path)), tiny_config()
  with pytest.raises(workdir_lib.WorkdirMismatchError,
                     match=r"trained on another dataset \(data\.dataset='wikitext103' in its "
                           r"data\.json, the config gives 'shakespeare'\)"):
    wd.check_before_start(build(config))
  config.data.dataset = "wikitext103"
  wd.check_before_start(build(config))  # the same corpus: nothing to refuse
  config.data.seq_len = 0
  with pytest.raises(ConfigError, match=r"^data\.seq_len=0 must be a positive integer"):
    wd.check_before_start(build(config))  # (refused as the RunConfig is built)


@pytest.mark.slow
@pytest.mark.parametrize("change", ["another model", "another width"])
def test_a_refused_run_leaves_every_file_byte_identical(trained, tiny_config, tmp_path, change):
  workdir = copy_of(trained, tmp_path)
  before = snapshot(workdir)
  config = tiny_config("bcmt" if change == "another model" else "dense", num_steps=20)
  if change == "another model":
    config.model.block_size = 8
  else:
    config.model.d_model = 64
  with pytest.raises(workdir_lib.WorkdirMismatchError, match="holds checkpoints of another model"):
    train.train_and_evaluate(build(config), workdir)
  assert snapshot(workdir) == before
  # ... and what reads the workdir still works.
  assert scoring.evaluate_workdir(workdir)["step"] == 10
  restored = restore_lib.restore(workdir, sharded=True, exports=False)
  model, tokenizer, step = restored.model, restored.tokenizer, restored.step
  assert step == 10 and generation.generate_text(model, tokenizer, "a", num_tokens=4)


@pytest.mark.slow
def test_another_corpus_is_refused_unless_allowed(trained, tiny_config, tmp_path):
  workdir = copy_of(trained, tmp_path)
  before = snapshot(workdir)
  folder = tmp_path / "notes"
  folder.mkdir()
  for i in range(4):  # a corpus of another text, with the same shapes
    (folder / f"note{i}.txt").write_text(("the river runs to the sea, note %d\n" % i) * 200)
  config = tiny_config(num_steps=20)
  config.data.update(dataset=f"text:{folder}/*.txt", archive="", archive_sha256="")
  with pytest.raises(workdir_lib.WorkdirMismatchError, match=r"trained on another dataset .*"
                     r"use a new --workdir, or set train.allow_new_data=True"):
    train.train_and_evaluate(build(config), workdir)
  assert snapshot(workdir) == before
  config.train.allow_new_data = True  # deliberate fine-tuning: continues, old tokenizer kept
  train.train_and_evaluate(build(config), workdir)
  identity = json.load(open(os.path.join(workdir, "data.json")))
  assert identity["dataset"].startswith("text:")
  old = json.load(open(os.path.join(trained, "data.json")))["tokenizer_sha256"]
  assert os.path.isfile(os.path.join(workdir, f"tokenizer.{old[:12]}.model"))
  assert max(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints"))) == 20


@pytest.mark.slow  # trains a tokenizer and a model, samples: ~10 s
def test_a_small_corpus_sets_the_vocabulary_and_samples(tiny_config, tmp_path, caplog):
  folder = tmp_path / "tiny"
  folder.mkdir()
  for i in range(3):
    (folder / f"{i}.txt").write_text("abc abd abe\n" * 60)
  config = tiny_config(num_steps=4, log_every=2, eval_every=4, checkpoint_every=4, sample_tokens=8)
  config.data.update(dataset=f"text:{folder}/*.txt", archive="", archive_sha256="", vocab_size=1024)
  config.train.sample_prompt = "ab"
  with caplog.at_level("INFO", logger="efficient_lm.training.loop"):
    summary = train.train_and_evaluate(build(config), str(tmp_path / "w"))
  saved = json.load(open(tmp_path / "w" / "config.json"))
  vocab = json.load(open(tmp_path / "w" / "data.json"))["vocab_size"]
  assert vocab < 1024 and saved["data"]["vocab_size"] == vocab == saved["model"]["vocab_size"]
  assert any("the model's vocabulary is" in r.getMessage() for r in caplog.records)
  assert summary["sample"].startswith("ab")
  restored = restore_lib.restore(str(tmp_path / "w"), sharded=True, exports=False)
  model, tokenizer = restored.model, restored.tokenizer
  assert generation.generate_text(model, tokenizer, "ab", num_tokens=16, temperature=1.0, top_k=0)


@pytest.mark.slow  # two command lines
def test_another_model_or_corpus_is_refused_before_any_work(trained, tiny_cli_args, tmp_path):
  """What config.json and data.json can answer is answered first, before jax starts: a rerun with
  another model, or with another corpus (a fresh data_dir stays absent); the workdir is
  byte-identical."""
  workdir = copy_of(trained, tmp_path)
  before = snapshot(workdir)
  model = [a.replace("configs/dense.py", "configs/bcmt.py") for a in tiny_cli_args(workdir)]
  corpus = tiny_cli_args(workdir) + [f"--config.data.dataset=text:{REPO}/docs/*.md",
                                     "--config.data.archive=", "--config.data.archive_sha256=",
                                     f"--config.data.data_dir={tmp_path / 'fresh'}"]
  for args, message in ((model + ["--config.model.block_size=8"], "holds checkpoints of another "
                         "model (model.name='dense', the config has 'bcmt')"),
                        (corpus, "was trained on another dataset (data.dataset='shakespeare' in "
                         "its data.json")):
    done = subprocess.run([sys.executable, "-m", "efficient_lm.main", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr[-2000:]
    assert "compiling" not in done.stderr and "Preparing" not in done.stderr
    assert "starting jax" not in done.stderr  # config.json and data.json answer before jax starts
  assert not (tmp_path / "fresh").exists()
  assert snapshot(workdir) == before


def test_a_glob_matching_nothing_stops_before_compiling_and_writes_nothing(tmp_path):
  args = [sys.executable, "-m", "efficient_lm.main", "--config=configs/dense.py",
          f"--workdir={tmp_path / 'w'}", f"--config.data.dataset=text:{tmp_path}/none/*.txt",
          f"--config.data.data_dir={tmp_path / 'd'}"]
  done = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=300)
  assert done.returncode == 2
  errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "matches no file" in errors[0], done.stderr[-2000:]
  assert "compiling" not in done.stderr
  assert not (tmp_path / "w").exists()
