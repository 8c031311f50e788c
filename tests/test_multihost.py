"""Many processes, one job: two local processes (gloo) train like one 4-device process."""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest

from conftest import REPO, fake_work_text, subprocess_env
from efficient_lm.config.data import DataConfig
from efficient_lm.config.errors import ConfigError
from efficient_lm.parallel import distributed
from efficient_lm.runtime import exit_codes

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
           while_running=None, faults=None, ended=None, envs=None):
  """Runs `python -m efficient_lm.main ARGS` as one job of `num_processes` local processes.

  Returns each process's (return code, output). Output goes to files (a full pipe must not stall
  a process); `while_running(processes, log_paths)` is called once all have started. `faults`:
  {process: [FAULT, N]}, run through tests/inject_fault.py. `ended`: a list that gets each
  process's end time (time.time()). `envs`: {process: extra environment}.
  """
  env = {k: v for k, v in subprocess_env(devices_per_process, JAX_PLATFORMS="cpu").items()
         if k not in LAUNCHER_ENV}
  job = []
  if num_processes > 1:
    job = [f"--coordinator_address=localhost:{free_port()}", f"--num_processes={num_processes}"]
  processes, logs = [], []
  for i in range(num_processes):
    logs.append(open(os.path.join(log_dir, f"process{i}.log"), "w+"))
    fault = (faults or {}).get(i)
    main = ["tests/inject_fault.py", *fault] if fault else ["-m", "efficient_lm.main"]
    command = [sys.executable, *main, *args, *job]
    command += [f"--process_id={i}"] if num_processes > 1 else []
    processes.append(subprocess.Popen(command, cwd=REPO, env={**env, **(envs or {}).get(i, {})},
                                      stdout=logs[-1], stderr=subprocess.STDOUT, text=True))
  results = []
  try:
    if while_running is not None:
      while_running(processes, [log.name for log in logs])
    deadline, end_times = time.time() + timeout, [None] * num_processes
    while None in end_times and time.time() < deadline:
      for i, process in enumerate(processes):
        if end_times[i] is None and process.poll() is not None:
          end_times[i] = time.time()
      time.sleep(0.05)
    for process, log in zip(processes, logs):
      process.wait(timeout=1)
      log.seek(0)
      results.append((process.returncode, log.read()))
    if ended is not None:
      ended.extend(end_times)
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
  records = read_metrics(runs["resumed"])  # every step once: the first run's lines after 10 moved
  assert [r["step"] for r in records if "loss" in r] == [5, 10, 15, 20, 25, 30]
  with open(os.path.join(runs["resumed"], "metrics.superseded.jsonl")) as f:
    assert [json.loads(line)["step"] for line in f if "\"loss\"" in line] == [15, 20, 25, 30]
  second = [r for r in records if r["step"] > 10]
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


def injected_at(output: str) -> float:
  """When tests/inject_fault.py sent its signal (time.time())."""
  return float(output.split("injected: ")[1].split(" at ")[1].split()[0])


@pytest.mark.slow  # two gloo processes, stopped and resumed: about a minute
@pytest.mark.parametrize("fault", ["SIGTERM@step", "SIGTERM@eval"])
def test_sigterm_to_one_process_saves_that_step_stops_both_and_resumes(runs, shakespeare_archive,
                                                                        tmp_path, fault):
  """SIGTERM reaches process 1 only (at a random train step, or during the evaluation at step 20):
  both processes stop within 30 s with the preemption status, one checkpoint committed at that
  step (one later: the processes agree one step behind); the same two commands then resume there
  and end at the uninterrupted job's losses."""
  n = random.Random().randint(2, 28) if fault == "SIGTERM@step" else 3
  workdir = str(tmp_path / "w")
  args = cli_args(shakespeare_archive, runs["data_dir"], workdir, num_steps=30, log_every=1000,
                  checkpoint_every=1000, sample_tokens=0)
  ended = []
  (rc0, output0), (rc1, output1) = launch(args, tmp_path, num_processes=2, devices_per_process=2,
                                          faults={1: [fault, str(n)]}, ended=ended)
  assert rc0 == rc1 == exit_codes.PREEMPTED, output0[-2000:] + output1[-2000:]
  assert max(ended) - injected_at(output1) < 30
  step = int(output1.split("stopped by SIGTERM at step ")[1].split(":")[0])
  assert f"stopped by SIGTERM (on another process of the job) at step {step}:" in output0
  assert step in ((n, n + 1) if fault == "SIGTERM@step" else (20,)), (n, step)
  saved = sorted(d for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
  assert saved == [str(step)]
  resumed = launch(args, tmp_path, num_processes=2, devices_per_process=2)
  assert [rc for rc, _ in resumed] == [0, 0], resumed[0][1][-2000:] + resumed[1][1][-2000:]
  assert f"at step {step}" in resumed[0][1].split("resumed from ")[1].splitlines()[0]
  assert losses(workdir)[30] == pytest.approx(losses(runs["job"])[30], rel=1e-6)
  assert evals(workdir) == pytest.approx(evals(runs["job"]), rel=1e-6)  # the cut evaluation too
  lines = [(r["step"], "eval_loss" in r) for r in read_metrics(workdir)]
  assert len(lines) == len(set(lines))  # every step's train and eval line once


@pytest.mark.slow  # two gloo processes, one checkpoint unreadable on one of them: about a minute
def test_hosts_agree_on_the_checkpoint_to_restore(runs, shakespeare_archive, tmp_path):
  """Process 1 cannot read checkpoint 30 (an I/O error injected into its reads): both processes
  restore step 20, checkpoint 30 is set aside once, and steps 21 to 30 train again to the job's
  losses (metrics.jsonl holds each step once; the first run's lines after 20 are kept aside)."""
  assert_ran(runs, "job")
  workdir = str(tmp_path / "w")
  shutil.copytree(runs["job"], workdir)
  args = cli_args(shakespeare_archive, runs["data_dir"], workdir, num_steps=30, sample_tokens=0)
  (rc0, output0), (rc1, output1) = launch(args, tmp_path, num_processes=2, devices_per_process=2,
                                          faults={1: ["unreadable", "30"]})
  assert rc0 == rc1 == 0, output0[-2000:] + output1[-2000:]
  assert "checkpoint 30 is corrupt or unreadable (not readable on process(es) 1)" in output0
  assert "Input/output error (injected" in output1
  assert "resumed from" in output0 and "at step 20" in output0.split("resumed from ")[1]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints_unreadable"))) == ["30"]
  assert losses(workdir) == pytest.approx(losses(runs["job"]), rel=1e-6)  # 25, 30 trained again
  assert evals(workdir) == pytest.approx(evals(runs["job"]), rel=1e-6)
  assert os.path.isfile(os.path.join(workdir, "metrics.superseded.jsonl"))  # the first 25, 30


@pytest.mark.slow  # two gloo processes, one killed mid-save: about a minute
def test_a_lost_process_ends_the_other_with_one_line(runs, shakespeare_archive, tmp_path):
  """Process 1 is SIGKILLed while its save of checkpoint 20 is in flight: process 0 ends within the
  heartbeat timeout with one `error:` line naming process 1 and checkpoint 10, exit status 4."""
  workdir = str(tmp_path / "w")
  args = cli_args(shakespeare_archive, runs["data_dir"], workdir, num_steps=40, sample_tokens=0)
  ended = []
  (rc0, output0), (rc1, _) = launch(args + ["--heartbeat_timeout=15"], tmp_path, num_processes=2,
                                    devices_per_process=2, faults={1: ["kill-in-save", "20"]},
                                    ended=ended)
  assert rc1 == -signal.SIGKILL and rc0 == exit_codes.PROCESS_LOST, output0[-3000:]
  errors = [line for line in output0.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "process 1 of the job stopped answering" in errors[0], errors
  assert f"the last committed checkpoint is step 10 in {workdir}/checkpoints" in errors[0]
  assert ended[0] - ended[1] < 15 + 15
  assert "Traceback" not in output0 and "Check failure" not in output0


def text_corpus(folder) -> str:
  """A `text:` dataset of five fixture files under `folder`."""
  os.makedirs(folder, exist_ok=True)
  for i in range(5):
    with open(os.path.join(folder, f"part{i}.txt"), "w") as f:
      f.write(fake_work_text(f"part{i}", 120))
  return f"text:{folder}/*.txt"


@pytest.mark.slow  # two gloo processes prepare a corpus: under a minute
def test_only_process_zero_reads_the_corpus_and_trains_the_tokenizer(tmp_path, shakespeare_archive):
  """A `text:` corpus on a shared data_dir: process 1 never reads the files in full nor trains a
  tokenizer (it fails if it tries); it lists them and reads what process 0 prepared."""
  args = cli_args(shakespeare_archive, str(tmp_path / "data"), str(tmp_path / "w"), num_steps=4,
                  eval_every=4, checkpoint_every=4, sample_tokens=0) + [
      f"--config.data.dataset={text_corpus(tmp_path / 'notes')}", "--config.data.archive=",
      "--config.data.archive_sha256="]
  results = launch(args, tmp_path, num_processes=2, devices_per_process=2,
                   faults={1: ["not-primary", "0"]})
  assert [rc for rc, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]


@pytest.mark.slow  # two gloo processes: under a minute
def test_per_host_data_dirs_must_hold_the_same_corpus(tmp_path, shakespeare_archive, tiny_config):
  """`data.data_dir=~/data` on hosts of their own ($HOME differs): allowed while the hosts'
  corpora agree; process 1's holding another tokenizer stops both before anything is written,
  one line naming it."""
  from efficient_lm import data  # pylint: disable=import-outside-toplevel
  dataset = text_corpus(tmp_path / "notes")
  config = tiny_config()
  config.data.update(dataset=dataset, archive="", archive_sha256="",
                     data_dir=str(tmp_path / "home0" / "data"))
  data.load(data.validate(DataConfig.from_mapping(config.data)))  # host 0's data_dir, prepared
  shutil.copytree(tmp_path / "home0", tmp_path / "home1")
  config.data.update(data_dir=str(tmp_path / "other"), vocab_size=320)
  # Another tokenizer, put where host 1's is.
  other = data.load(data.validate(DataConfig.from_mapping(config.data))).tokenizer.model_path
  [mine] = [os.path.join(root, "spm.model") for root, _, files in
            os.walk(tmp_path / "home1" / "data" / "tokenizers") if "spm.model" in files]
  shutil.copyfile(other, mine)
  args = cli_args(shakespeare_archive, "~/data", str(tmp_path / "w"), num_steps=4, eval_every=4,
                  checkpoint_every=4, sample_tokens=0) + [
      f"--config.data.dataset={dataset}", "--config.data.archive=", "--config.data.archive_sha256="]
  results = launch(args, tmp_path, num_processes=2, devices_per_process=2,
                   envs={i: {"HOME": str(tmp_path / f"home{i}")} for i in range(2)})
  for rc, output in results:
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert rc == exit_codes.USAGE and len(errors) == 1, output[-2000:]
    assert errors[0].startswith("error: process(es) 1 prepared another corpus or tokenizer than "
                                "process 0"), errors
  assert not os.path.exists(tmp_path / "w" / "checkpoints")


@pytest.mark.slow  # two gloo processes train, then resume: ~2 min
def test_per_host_data_dirs_prepared_apart_give_every_process_the_same_token_ids(
    tmp_path, shakespeare_archive):
  """Two hosts each with an empty `data.data_dir=~/data` of their own ($HOME differs): each trains
  the library's tokenizer, byte for byte the same, so the job trains on the same token ids.
  Continued with `--workdir` alone under two more empty data_dirs, every process tokenizes with
  the workdir's tokenizer: none trains one."""
  workdir = str(tmp_path / "w")
  args = cli_args(shakespeare_archive, "~/data", workdir, num_steps=4, eval_every=4,
                  checkpoint_every=4, sample_tokens=0)
  for run, more in (("first", args), ("later", [f"--workdir={workdir}",
                                                "--config.train.num_steps=8"])):
    os.makedirs(tmp_path / run)
    results = launch(more, tmp_path / run, num_processes=2, devices_per_process=2,
                     envs={i: {"HOME": str(tmp_path / run / f"home{i}")} for i in range(2)})
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
  trained = [os.path.join(root, "spm.model") for i in range(2) for root, _, files in
             os.walk(tmp_path / "first" / f"home{i}" / "data" / "tokenizers") if "spm.model" in files]
  assert len(trained) == 2
  with open(os.path.join(workdir, "tokenizer.model"), "rb") as f:
    kept = f.read()
  for path in trained:
    with open(path, "rb") as f:
      assert f.read() == kept
  for i in range(2):
    assert os.path.isdir(tmp_path / "later" / f"home{i}" / "data" / "tokens")
    assert not os.path.exists(tmp_path / "later" / f"home{i}" / "data" / "tokenizers")
  assert max(losses(workdir)) == 8


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
