"""The command lines: every mistake is one line and exit status 2; configs by name as by path."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, fast_first
from efficient_lm.cli import common as cli
from efficient_lm.config.errors import ConfigError


def run(args, cwd=REPO, module="efficient_lm.main"):
  return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                        cwd=cwd, timeout=300)


@pytest.mark.parametrize("args,expected", fast_first([
    (["--config=configs/dense.py", "--config.train.num_step=5"],
     "error: --config.train.num_step is not a config field; did you mean train.num_steps"),
    (["--config=configs/dense.py", "--config.train.num_steps=abc"],
     "error: --config.train.num_steps=abc is not an integer"),
    (["--config=configs/nope.py"], "error: --config='configs/nope.py' is neither a config file nor"),
    (["--config=configs/bcmt.py:1024"],
     "error: --config=configs/bcmt.py:1024: unknown configs/bcmt.py preset '1024'; use one of 64"),
    (["--config=bcmt:1024"], "error: --config=bcmt:1024: unknown configs/bcmt.py preset"),
    (["--config=configs/dense.py", "--bogus_flag=1"], "error: Unknown command line flag 'bogus_flag'"),
    (["--config=configs/dense.py", "--target=tpu:v5e:2x2"], "error: --target compiles for"),
], keep=(0,)))
def test_every_command_line_mistake_is_one_line(args, expected, tmp_path):
  done = run(args + [f"--workdir={tmp_path / 'w'}"])
  assert done.returncode == 2, done.stderr[-2000:]
  lines = [line for line in done.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith(expected), lines
  assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_the_other_command_lines_too(tmp_path):
  for module in ("efficient_lm.evaluate", "efficient_lm.sample"):
    done = run([f"--workdir={tmp_path}", "--no_such_flag=1"], module=module)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: Unknown command line flag 'no_such_flag'"], done.stderr


@pytest.mark.slow
def test_configs_by_name_from_anywhere(tmp_path):
  """A shipped config by name (and with a preset) from a directory that is not a checkout."""
  assert set(cli.config_names()) >= {"dense", "pi_attention", "bcmt", "ecp", "perceiver_ar",
                                     "sliding_window"}
  assert cli.load_config("bcmt:honly128").model.block_size == 128
  with pytest.raises(ConfigError, match="one of bcmt, dense, ecp"):
    cli.resolve("nonesuch")
  done = run(["--config=sliding_window", "--compile_only", "--config.data.seq_len=64",
              "--config.model.d_model=32", "--config.model.num_heads=2",
              "--config.data.vocab_size=300", "--config.mesh.fsdp=1"], cwd=str(tmp_path))
  assert done.returncode == 0, done.stderr[-2000:]
  assert json.loads(done.stdout.strip().splitlines()[-1])["model"] == "sliding_window"
  assert os.listdir(tmp_path) == []
