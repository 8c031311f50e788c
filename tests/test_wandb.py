"""W&B logging (`train.wandb=True`), offline: the figures metrics.jsonl gets, the config, one run
id across a resume, and a missing package refused before anything compiles."""

import glob
import json
import os
import struct
import sys

import pytest

from conftest import build, load_config
from efficient_lm.config.errors import ConfigError
from efficient_lm.training import loop as train
from efficient_lm.training import start as train_start
from efficient_lm.training import metrics as metrics_lib
from efficient_lm.training import wandb as wandb_writer


@pytest.fixture
def offline(tmp_path, monkeypatch):
  """W&B offline, quiet, no git or system probing; its runs under tmp_path/wandb_dir."""
  folder = tmp_path / "wandb_dir"
  folder.mkdir()
  for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(folder), "WANDB_SILENT": "true",
                      "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
                      "WANDB__DISABLE_STATS": "true", "WANDB__DISABLE_META": "true",
                      "WANDB_CONSOLE": "off", "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
                      "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache")}.items():
    monkeypatch.setenv(name, value)
  yield folder
  import wandb  # pylint: disable=import-outside-toplevel
  wandb.teardown()  # the service process ends with the test


def _records(path: str) -> list:
  """The protobuf records of a `.wandb` file (a LevelDB-style log of 32 KiB blocks after a
  7-byte header: each chunk a 7-byte header, crc32 / length / type, full=1, first/middle/last)."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=import-outside-toplevel
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B"
  pos, block, chunks, out = 7, 32768, b"", []
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header: padding
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if length == 0 and kind == 0:
      break
    chunks += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(chunks)
      out.append(record)
      chunks = b""
  return out


def _history(path: str) -> dict[int, dict[str, float]]:
  """step -> the figures logged at it (W&B's own `_...` keys left out)."""
  rows = {}
  for record in _records(path):
    if record.WhichOneof("record_type") == "history":
      items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
               for item in record.history.item}
      step = int(items.pop("_step"))
      rows.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
  return rows


def _run_record(path: str):
  return next(r.run for r in _records(path) if r.WhichOneof("record_type") == "run")


def test_offline_run_logs_what_metrics_jsonl_gets_and_a_resume_keeps_its_id(
    tiny_config, tmp_path, offline):
  workdir = str(tmp_path / "run")
  overrides = dict(wandb=True, wandb_project="tests", wandb_run_name="tiny", wandb_tags="a, b",
                   log_every=5, eval_every=10, checkpoint_every=10, sample_tokens=0)
  train.train_and_evaluate(build(tiny_config(num_steps=10, **overrides)), workdir)
  with open(os.path.join(workdir, wandb_writer.RUN_ID_FILE), encoding="utf-8") as f:
    run_id = f.read().strip()
  first = glob.glob(str(offline / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
  assert len(first) == 1, os.listdir(offline / "wandb")

  train.train_and_evaluate(build(tiny_config(num_steps=20, **overrides)), workdir)  # resumes at 10
  with open(os.path.join(workdir, wandb_writer.RUN_ID_FILE), encoding="utf-8") as f:
    assert f.read().strip() == run_id
  runs = sorted(glob.glob(str(offline / "wandb" / "offline-run-*" / "run-*.wandb")))
  assert len(runs) == 2 and all(path.endswith(f"run-{run_id}.wandb") for path in runs), runs
  second = [path for path in runs if path != first[0]][0]
  # Read the files once W&B's service has closed them: in a CI run (a loaded machine, other tests
  # beside) the second file, read straight after `run.finish()`, once held no run record, and it
  # passed alone. The service's teardown waits for every file it writes.
  import wandb  # pylint: disable=import-outside-toplevel
  wandb.teardown()

  record = _run_record(first[0])
  assert (record.run_id, record.display_name, list(record.tags)) == (run_id, "tiny", ["a", "b"])
  config = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in record.config.update}
  assert config["train"]["wandb_project"] == "tests" and config["model"]["d_model"] == 32
  assert _run_record(second).run_id == run_id

  logged = {**_history(first[0]), **_history(second)}
  expected = {}
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      record = json.loads(line)
      expected.setdefault(record.pop("step"), {}).update(record)
  assert sorted(logged) == sorted(expected) == [5, 10, 15, 20]
  for step, figures in expected.items():
    assert logged[step] == pytest.approx(figures, rel=1e-6), step


def test_a_missing_package_is_one_config_error_before_anything_compiles(
    tiny_config, tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  monkeypatch.setattr(train_start, "setup", lambda *a: pytest.fail("setup ran before the check"))
  with pytest.raises(ConfigError) as e:
    train.train_and_evaluate(build(tiny_config(wandb=True)), str(tmp_path / "w"))
  message = str(e.value)
  assert "train.wandb=True" in message and "pip install -e '.[wandb]'" in message
  assert "\n" not in message
  assert not os.path.exists(tmp_path / "w")


def test_bad_wandb_fields_name_the_field():
  """The `train.wandb*` fields' declared checks, run as the RunConfig is built (`config.run.build`,
  before anything compiles): each bad value one ConfigError naming its field."""
  good = dict(wandb=False, wandb_project="p", wandb_run_name="", wandb_tags="")

  def run(**fields):
    config = load_config("dense").to_dict()  # a plain mapping takes a value of another type
    config["train"].update({**good, **fields})
    return build(config)

  wandb_writer.check(run().train)
  for field, value in (("wandb", "yes"), ("wandb_project", ""), ("wandb_tags", 3)):
    with pytest.raises(ConfigError, match=f"train.{field}="):
      run(**{field: value})


def test_fan_out_writes_every_writer_and_closes_them_all():

  class Recorder:

    def __init__(self, fail_close=False):
      self.lines, self.closed, self.fail_close = [], False, fail_close

    def write(self, step, metrics):
      self.lines.append((step, dict(metrics)))

    def close(self):
      self.closed = True
      if self.fail_close:
        raise OSError("disk gone")

  first, second = Recorder(fail_close=True), Recorder()
  fan = metrics_lib.FanOut(first, second)
  fan.write(3, {"loss": 1.5})
  assert first.lines == second.lines == [(3, {"loss": 1.5})]
  with pytest.raises(OSError, match="disk gone"):
    fan.close()
  assert first.closed and second.closed


def test_tags_split_on_commas():
  assert wandb_writer.tags(" pi, ablation,,x ") == ["pi", "ablation", "x"]
  assert not wandb_writer.tags("")
