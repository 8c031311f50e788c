"""experiments/config_route.py: the counter on a hand-made trace, and the tool on a tiny run."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env
from experiments import config_route


def test_visits_and_climbs_of_a_hand_made_trace():
  trace = [("efficient_lm.cli.train_command", "_run"),
           ("efficient_lm.state.workdir", "check_usable"),
           ("efficient_lm.training.loop", "train_and_evaluate"),
           ("efficient_lm.training.loop", "setup"),
           ("efficient_lm.training.prepare", "validate"), ("efficient_lm.data.config", "validate"),
           ("efficient_lm.config.fields", "Section.from_mapping"),
           ("efficient_lm.models.decoder", "Decoder.__init__"),
           ("efficient_lm.models.pi_attention", "make_pi_mixer"),
           ("efficient_lm.models.decoder", "Block.__init__"),
           ("efficient_lm.training.loop", "_compiled_step")]
  counted = config_route.count(trace)
  assert counted["visits"] == {"efficient_lm.training.loop": 2, "efficient_lm.models.decoder": 2,
                               "efficient_lm.cli.train_command": 1,
                               "efficient_lm.state.workdir": 1,
                               "efficient_lm.training.prepare": 1, "efficient_lm.data.config": 1,
                               "efficient_lm.config.fields": 1,
                               "efficient_lm.models.pi_attention": 1}
  # workdir (4) -> training.loop (3), loop -> training.prepare (0), data.config (1) ->
  # config.fields (0); the calls inside one module (train_and_evaluate, setup) are one visit, and the model's
  # modules are one layer (decoder <-> pi_attention is no climb).
  assert [(c["from"], c["to"]) for c in counted["climbs"]] == [
      ("efficient_lm.state.workdir", "efficient_lm.training.loop"),
      ("efficient_lm.training.loop", "efficient_lm.training.prepare"),
      ("efficient_lm.data.config", "efficient_lm.config.fields")]
  assert counted["climbs"][1]["from_function"] == "setup"
  assert (counted["num_climbs"], counted["most_visits"], counted["meets_goal"]) == (3, 2, True)
  assert not config_route.count(trace * 4)["meets_goal"]  # 8 visits to train, 15 climbs


def test_layers():
  assert config_route.layer_of("efficient_lm.models.decoder") == 2
  assert config_route.layer_of("efficient_lm.data.config") == 1
  assert config_route.layer_of("efficient_lm.parallel.sharding") == 0
  assert config_route.layer_of("efficient_lm.state.checkpoint") == 4
  with pytest.raises(KeyError, match="numpy has no layer"):
    config_route.layer_of("numpy")


def test_the_route_of_a_tiny_run(shakespeare_archive, tiny_data_dir, tmp_path):
  """One step of π at tiny sizes on the fixture corpus: the JSON's figures are its trace's."""
  archive, sha = shakespeare_archive
  out = tmp_path / "route.json"
  done = subprocess.run(
      [sys.executable, "-m", "experiments.config_route", "--steps=1", f"--out={out}", "--",
       f"--config.data.archive={archive}", f"--config.data.archive_sha256={sha}",
       f"--config.data.data_dir={tiny_data_dir}", "--config.data.seq_len=32",
       "--config.data.vocab_size=384"],
      cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(out.read_text())
  trace = [tuple(t.rsplit(":", 1)) for t in result["trace"]]
  assert result["calls"] == len(trace) > 0
  recount = config_route.count(trace)
  assert {k: recount[k] for k in ("visits", "climbs", "num_climbs", "most_visits")} == {
      k: result[k] for k in ("visits", "climbs", "num_climbs", "most_visits")}
  for module in ("efficient_lm.training.prepare", "efficient_lm.models", "efficient_lm.training.loop"):
    assert module in result["visits"], module
  # The goal, kept: the config typed once at the edge and handed down.
  assert result["meets_goal"], done.stderr[-3000:]
  # The edge runs once (`prepare`; its `place` is entered again after the data's checks, a second
  # visit to the module but not a second run).
  assert trace.count(("efficient_lm.training.prepare", "prepare")) == 1
  assert "climbs:" in done.stderr and "visits per module" in done.stderr
  assert os.path.basename(result["config"]) == "pi_attention.py"
