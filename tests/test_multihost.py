"""Many processes, one job: two local processes (gloo) train like one 4-device process."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest

from conftest import REPO, subprocess_env
from efficient_lm import distributed
from efficient_lm.validation import ConfigError

# The module's trained fixture is built once: its tests run on one xdist worker (--dist=loadgroup).
pytestmark = pytest.mark.xdist_group("multihost_runs")

# Environment that would make a child (or this process) join some other job.
LAUNCHER_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_STEP_NODELIST",
                "SLURM_PROCID", "SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE",
                "TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def losses(workdir):
  return {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}


def evals(workdir):
  return {r["step"]: r["eval_loss"] for r in read_metrics(workdir) if "eval_loss" in r}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def launch(args, log_dir, *, num_processes: int, devices_per_process: int, timeout: int = 240,
           while_running=None):
  """Runs `python -m efficient_lm.main ARGS` as one job of `num_processes` local processes.

  Returns each process's (return code, output). Output goes to files (a full pipe must not stall
  a process); `while_running(processes, log_paths)` is called once all have started.
  """
  env = {k: v for k, v in subprocess_env(devices_per_process, JAX_PLATFORMS="cpu").items()
         if k not in LAUNCHER_ENV}
  job = []
  if num_processes > 1:
    job = [f"--coordinator_address=localhost:{free_port()}", f"--num_processes={num_processes}"]
  processes, logs = [], []
  for i in range(num_processes):
    logs.append(open(os.path.join(log_dir, f"process{i}.log"), "w+"))
    command = [sys.executable, "-m", "efficient_lm.main", *args, *job]
    command += [f"--process_id={i}"] if num_processes > 1 else []
    processes.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=logs[-1],
                                      stderr=subprocess.STDOUT, text=True))
  results = []
  try:
    if while_running is not None:
      while_running(processes, [log.name for log in logs])
    for process, log in zip(processes, logs):
      process.wait(timeout=timeout)
      log.seek(0)
      results.append((process.returncode, log.read()))
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
    for log in logs:
      log.close()
  return results


def cli_args(archive, data_dir, workdir, **train_overrides):
  """The tiny dense config on every device of the job (`mesh.fsdp=-1`: parameters and optimizer
  state sharded 4 ways, across the two processes)."""
  from conftest import _tiny_sections  # the CLI fixture is function-scoped
  sections = _tiny_sections(archive, data_dir, train_overrides)
  sections["mesh"] = dict(data=1, fsdp=-1, tensor=1, context=1)
  return ["--config=configs/dense.py", f"--workdir={workdir}"] + [
      f"--config.{section}.{k}={v}" for section, fields in sections.items() for k, v in fields.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shakespeare_archive):
  """Three launches of the tiny 30-step dense run (checkpoints every 10 steps, eval at 20 and 30).

  job: two processes with 2 devices each, on a fresh data_dir they prepare together;
  single: one process with 4 devices on that data; resumed: a copy of the job's workdir
  without checkpoints 20 and 30, run again by two processes (restores step 10). Only the job
  samples at the end (a collective every process must join); the others skip it to save time.
  """
  root = tmp_path_factory.mktemp("multihost")
  data_dir = str(root / "data")

  def args(workdir, sample_tokens=8):
    return cli_args(shakespeare_archive, data_dir, workdir, num_steps=30, sample_tokens=sample_tokens)

  out = {name: str(root / name) for name in ("job", "single", "resumed")}
  for name in out:
    os.makedirs(root / f"{name}_logs")
  out["job_logs"] = launch(args(out["job"]), root / "job_logs", num_processes=2, devices_per_process=2)
  out["single_logs"] = launch(args(out["single"], sample_tokens=0), root / "single_logs", num_processes=1,
                              devices_per_process=4)
  if os.path.isdir(os.path.join(out["job"], "checkpoints")):
    shutil.copytree(out["job"], out["resumed"])
    for step in ("20", "30"):
      shutil.rmtree(os.path.join(out["resumed"], "checkpoints", step))
  out["resumed_logs"] = launch(args(out["resumed"], sample_tokens=0), root / "resumed_logs", num_processes=2,
                               devices_per_process=2)
  out["data_dir"] = data_dir
  return out


def assert_ran(runs, name):
  for rc, output in runs[f"{name}_logs"]:
    assert rc == 0, f"{name}: {output[-3000:]}"


@pytest.mark.slow  # two gloo processes train in subprocesses: over a minute
def test_two_processes_train_like_one_process_with_four_devices(runs):
  assert_ran(runs, "job")
  assert_ran(runs, "single")
  assert "one job of 2 processes over 4 devices (2 here)" in runs["job_logs"][0][1]
  assert "each process reads its own 2 of the 4 rows of every batch" in runs["job_logs"][0][1]
  reference, job = losses(runs["single"]), losses(runs["job"])
  assert sorted(job) == sorted(reference) == [5, 10, 15, 20, 25, 30]
  for step, loss in job.items():
    assert loss == pytest.approx(reference[step], rel=1e-5), step
  assert sorted(evals(runs["job"])) == sorted(evals(runs["single"])) == [20, 30]
  for step, loss in evals(runs["job"]).items():
    assert loss == pytest.approx(evals(runs["single"])[step], rel=1e-5), step


@pytest.mark.slow  # two gloo processes train in subprocesses: over a minute
def test_two_processes_restore_their_checkpoint_and_continue_identically(runs):
  assert_ran(runs, "resumed")
  assert "resumed from" in runs["resumed_logs"][0][1] and "at step 10" in runs["resumed_logs"][0][1]
  second = read_metrics(runs["resumed"])[len(read_metrics(runs["job"])):]  # what the rerun appended
  assert [r["step"] for r in second if "loss" in r] == [15, 20, 25, 30]
  job = losses(runs["job"])
  for r in second:
    if "loss" in r:
      assert r["loss"] == pytest.approx(job[r["step"]], rel=1e-6), r
    if "eval_loss" in r:
      assert r["eval_loss"] == pytest.approx(evals(runs["job"])[r["step"]], rel=1e-6), r
  steps = sorted(int(d) for d in os.listdir(os.path.join(runs["resumed"], "checkpoints")) if d.isdigit())
  assert steps == [10, 20, 30]


@pytest.mark.slow  # two gloo processes train in subprocesses: over a minute
def test_only_process_zero_writes_and_logs(runs):
  assert_ran(runs, "job")
  assert [r["step"] for r in read_metrics(runs["job"]) if "loss" in r] == [5, 10, 15, 20, 25, 30]
  events = os.listdir(os.path.join(runs["job"], "tensorboard"))
  assert len([e for e in events if e.startswith("events.out.tfevents")]) == 1
  (_, output0), (_, output1) = runs["job_logs"]
  assert "step 30/30" in output0 and "eval at step 30" in output0 and "sample:" in output0
  assert "step 5/" not in output1 and "eval at step" not in output1 and "sample:" not in output1
  assert os.path.isfile(os.path.join(runs["job"], "config.json"))
  assert os.path.isfile(os.path.join(runs["job"], "tokenizer.model"))
  for root, _, files in os.walk(runs["data_dir"]):  # prepared by process 0 alone: no leftovers
    assert not [f for f in files if ".tmp" in f or f.startswith(".write_test")], (root, files)


@pytest.mark.slow  # two gloo processes train in subprocesses: over a minute
def test_sigterm_to_one_process_stops_the_whole_job_at_one_step(runs, shakespeare_archive, tmp_path):
  """The signal reaches process 1 only; both agree at the next log step, save it together, exit 0."""
  workdir = str(tmp_path / "preempted")

  def stop_process_one(processes, log_paths):
    deadline = time.time() + 200
    while "step 10/" not in open(log_paths[0]).read():
      assert all(p.poll() is None for p in processes) and time.time() < deadline, "job did not start"
      time.sleep(0.1)
    processes[1].send_signal(signal.SIGTERM)

  args = cli_args(shakespeare_archive, runs["data_dir"], workdir, num_steps=3000, eval_every=10000,
                  checkpoint_every=10000, sample_tokens=0)
  (rc0, output0), (rc1, output1) = launch(args, tmp_path, num_processes=2, devices_per_process=2,
                                          while_running=stop_process_one)
  assert rc0 == 0 and rc1 == 0, output0[-2000:] + output1[-2000:]
  step = int(output1.split("received SIGTERM at step ")[1].split(":")[0])
  assert f"received a stop signal on another process at step {step}:" in output0
  assert step % 5 == 0 and 15 <= step < 3000  # a log step after the one seen
  saved = [d for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()]
  assert saved == [str(step)]


# ---------------------------------------------------------------------------------------------
# Joining a job: flags, their environment fallbacks, cluster detection; a plain process is left alone.


@pytest.fixture
def clean_env(monkeypatch):
  for name in LAUNCHER_ENV:
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


def test_a_plain_single_process_does_not_initialize(clean_env):
  assert distributed.cluster_environment() is None
  assert distributed.initialize_distributed() is False
  assert distributed.initialize_distributed(num_processes=1) is False
  assert not jax.distributed.is_initialized()


@pytest.mark.parametrize("env, expected", [
    ({"SLURM_STEP_NODELIST": "node[1-2]", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM"),
    ({"SLURM_STEP_NODELIST": "node1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, None),
    ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "4"}, "Open MPI"),
    ({"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}, "Cloud TPU"),
])
def test_cluster_environment_is_detected(clean_env, env, expected):
  for name, value in env.items():
    clean_env.setenv(name, value)
  assert distributed.cluster_environment() == expected


@pytest.mark.parametrize("kwargs, env, message", [
    (dict(num_processes=2, process_id=0), {}, "--coordinator_address missing"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "localhost:1234"}, "--num_processes, --process_id missing"),
    (dict(coordinator_address="localhost:1", num_processes=2, process_id=2), {},
     "--process_id=2 must be in [0, --num_processes=2)"),
])
def test_incomplete_or_bad_flags_are_named(clean_env, kwargs, env, message):
  for name, value in env.items():
    clean_env.setenv(name, value)
  with pytest.raises(ConfigError) as error:
    distributed.initialize_distributed(**kwargs)
  assert str(error.value).startswith(message), str(error.value)
  assert not jax.distributed.is_initialized()
