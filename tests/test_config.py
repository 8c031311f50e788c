"""Config files and their validation: one clear line naming the field, before any work."""

import subprocess
import sys
import time

import pytest

from conftest import REPO, build, load_config
from efficient_lm.config.errors import ConfigError
from efficient_lm.training import prepare as config_check


def test_dense_config_is_valid_and_linked():
  config = load_config("dense")
  config_check.validate(build(config))
  config.data.seq_len = 512
  config.data.vocab_size = 1024
  assert config.model.seq_len == 512  # field references: one override changes both
  assert config.model.vocab_size == 1024


def test_missing_fields_are_filled_with_their_defaults_once(tmp_path):
  """A config written before fields existed (an older workdir's config.json, a hand-written one)
  gets them at the base config's defaults, at the door, so the library reads fields only."""
  import json  # pylint: disable=import-outside-toplevel
  import ml_collections  # pylint: disable=import-outside-toplevel
  from efficient_lm.state import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  full = load_config("pi_attention")
  old = full.to_dict()
  for section, field in (("train", "loss_chunk"), ("train", "profile_steps"),
                         ("model", "seq_chunk"), ("mesh", "activation_rules")):
    del old[section][field]
  del old["mesh"]["rules"]["embed"]
  (tmp_path / "config.json").write_text(json.dumps(old))
  saved = workdir_lib.Workdir(str(tmp_path)).saved_config()
  assert saved.train.loss_chunk == 8192 and saved.train.profile_steps == ""
  assert saved.model.seq_chunk == 0  # the base default (configs/pi_attention.py sets 8192)
  assert saved.mesh.rules["embed"] == "fsdp" and saved.mesh.activation_rules["mlp"] == "tensor"
  assert saved.model.window == full.model.window  # what the file had is kept
  handwritten = ml_collections.ConfigDict(old)
  assert config_check.validate(build(handwritten)).train.loss_chunk == 8192


@pytest.mark.parametrize("section,field,value", [
    ("train", "learning_rate", 0.0),
    ("train", "num_steps", 0),
    ("train", "warmup_steps", -1),
    ("train", "eval_every", 0),
    ("train", "keep_checkpoints", 0),
    ("data", "dataset", "imagenet"),
    ("data", "batch_size", 0),
    ("data", "vocab_size", 100),
    ("data", "seq_len", -4),
    ("model", "name", "gpt5"),
    ("model", "num_layers", 0),
    ("model", "d_model", 250),
    ("mesh", "data", 3),
    ("mesh", "fsdp", 0),
    ("mesh", "tensor", 3),
    ("mesh", "context", 3),
    ("train", "eval_split", "valdation"),
    ("train", "schedule", "linear"),
    ("train", "decay_fraction", 0.0),
])
def test_bad_field_is_named(section, field, value):
  config = load_config("dense")
  config[section][field] = value
  with pytest.raises(ConfigError) as error:
    config_check.validate(build(config))
  message = str(error.value)
  if (section, field) == ("data", "seq_len"):  # a field reference: reported at either name
    assert "seq_len=-4" in message
  else:
    assert message.startswith(f"{section}.{field}={value!r}"), message
  assert ";" in message and len(message.splitlines()) == 1  # the fix follows, on one line


def test_cli_bad_config_fails_fast_with_one_line(tmp_path):
  workdir = tmp_path / "never"
  start = time.time()
  result = subprocess.run(
      [sys.executable, "-m", "efficient_lm.main", "--config=configs/dense.py",
       f"--workdir={workdir}", "--config.model.d_model=250"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1].startswith("error: model.d_model=250 must be divisible")
  assert not workdir.exists()  # nothing prepared, nothing written
  assert time.time() - start < 30


def test_eval_split_typo_lists_the_splits():
  config = load_config("dense")
  config.train.eval_split = "valdation"
  with pytest.raises(ConfigError, match="one of train, validation, test, test_milton"):
    config_check.validate(build(config))


def test_eval_split_of_a_text_folder_without_validation_is_refused():
  config = load_config("dense")
  config.data.dataset = "text:~/notes/*.txt"
  config.data.validation_fraction = 0.0
  with pytest.raises(ConfigError, match=r"train.eval_split='validation' is not a split .*one of train, test"):
    config_check.validate(build(config))
