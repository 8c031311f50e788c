"""Ctrl-C and SIGTERM in every phase of every command: one line, the documented status, nothing
half-written, and the same command then goes on.

Each test runs a command in a subprocess; tests/inject_fault.py sends the (real) signal at a
chosen moment (a train step, a document of the tokenizer's, N ms into the compile, ...), or the
test sends it from outside (a background job, a stalled download).
"""

import hashlib
import http.server
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile

import pytest

from conftest import REPO, fake_work_text, fast_first, subprocess_env
from efficient_lm.runtime import exit_codes
from efficient_lm.runtime import signals

# Names that only a file or folder on its way somewhere leaves (ours, TFDS's, tempfile's).
TEMPORARY = (".tmp", ".part", ".incomplete", ".pip.", ".write_test", "tmp")


def command(args, fault=None, module="main", **popen):
  """(`python -m efficient_lm.<module> ARGS`, or through tests/inject_fault.py with `fault`)."""
  head = ["tests/inject_fault.py", *fault, *([module] if module != "main" else [])] if fault else [
      "-m", f"efficient_lm.{module}"]
  return subprocess.Popen([sys.executable, *head, *args], cwd=REPO, env=subprocess_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(process, timeout=300):
  out, err = process.communicate(timeout=timeout)
  return process.returncode, out, err


def stop_lines(stderr: str) -> list[str]:
  return [line for line in stderr.splitlines() if line.startswith(("stopped by", "error:"))]


def leftovers(folder) -> list[str]:
  """Paths under `folder` whose names say they are temporary."""
  found = []
  for root, dirs, files in os.walk(folder):
    for name in dirs + files:
      if any(mark in name for mark in TEMPORARY):
        found.append(os.path.join(root, name))
  return found


def checkpoints(workdir) -> list[int]:
  folder = os.path.join(workdir, "checkpoints")
  return sorted(int(d) for d in os.listdir(folder) if d.isdigit()) if os.path.isdir(folder) else []


def metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture
def args(tiny_cli_args, tmp_path):
  """The tiny dense run's arguments in a fresh workdir (and, `fresh_data=True`, a fresh
  data_dir: the archive is prepared, a tokenizer trained and the splits tokenized)."""

  def make(fresh_data=False, **train):
    out = tiny_cli_args(str(tmp_path / "w"), **train)
    if fresh_data:
      out.append(f"--config.data.data_dir={tmp_path / 'data'}")
    return out

  return make


def test_a_stop_a_library_swallowed_is_named_for_the_phase_it_came_in():
  """A signal's handler raises at whatever bytecode runs next; inside a library's bare `except:`
  (jax has some right after the compile returns) the stop is swallowed, and the phase's end stops
  the command: named for that phase, not for the one outside it. (Before: "while starting", from
  a CI run whose SIGINT landed as the compile returned.)"""
  try:
    with pytest.raises(signals.Interrupted) as stop:
      with signals.phase("preparing"):
        with signals.phase("compiling the train step for cpu"):
          try:
            signals._handle(signal.SIGINT, None)  # pylint: disable=protected-access
          except:  # noqa: E722  pylint: disable=bare-except
            pass  # what jax's pxla does with anything raised while it reads the executable
          assert signals.requested() == "SIGINT"
    assert stop.value.phase == "compiling the train step for cpu"
    assert signals.current_phase() == "starting"
  finally:
    signals.reset()
  assert signals.requested() is None


@pytest.mark.parametrize("fault, status, phase", fast_first([  # each case ~15 s: one in the fast tier
    pytest.param(["SIGINT@compile", "300"], exit_codes.INTERRUPTED,
                 "compiling the train step for cpu", id="compile"),
    pytest.param(["SIGTERM@tokenizer", "2"], exit_codes.PREEMPTED, "training a 384-piece tokenizer",
                 id="tokenizer"),
    pytest.param(["SIGINT@tokenizing", "1"], exit_codes.INTERRUPTED, "tokenizing the train split",
                 id="tokenizing"),
]))
def test_a_stop_before_training_keeps_nothing_and_the_rerun_completes(args, tmp_path, fault,
                                                                       status, phase):
  """A first signal outside the training loop ends the command within seconds, with one line
  naming the phase, no temporary file or folder in the data directory and no workdir; the same
  command then runs to the end. (Before: a Ctrl-C in the compile segfaulted, exit -11; a SIGTERM
  in preparation left a tmp folder in tokenizers/.)"""
  process = command(args(fresh_data=True, num_steps=4, checkpoint_every=4, eval_every=4,
                         sample_tokens=0), fault)
  rc, out, err = finish(process)
  assert rc == status, err[-3000:]
  sent = float(err.split("injected: ")[1].split(" at ")[1].split()[0])
  lines = stop_lines(err)
  assert lines == [lines[0]] and lines[0].startswith(
      f"stopped by {fault[0].split('@')[0]} while {phase}: nothing was left half-written"), lines
  assert time.time() - sent < 30 and out == ""
  assert leftovers(tmp_path / "data") == [] and not (tmp_path / "w").exists()
  rc, out, err = finish(command(args(fresh_data=True, num_steps=4, checkpoint_every=4,
                                     eval_every=4, sample_tokens=0)))
  assert rc == 0, err[-3000:]
  assert json.loads(out)["step"] == 4 and leftovers(tmp_path / "data") == []


@pytest.mark.slow  # two training subprocesses
@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_a_stop_in_training_commits_that_step(args, tmp_path, signal_name):
  """A signal at step 7 (checkpoints every 10): checkpoint 7 is committed, one line says so, the
  status is 130 (SIGINT) or 75 (SIGTERM: preempted, resumable); the rerun resumes at 7."""
  rc, out, err = finish(command(args(sample_tokens=0), [f"{signal_name}@step", "7"]))
  status = exit_codes.INTERRUPTED if signal_name == "SIGINT" else exit_codes.PREEMPTED
  assert rc == status and out == "", err[-3000:]
  assert stop_lines(err) == [f"stopped by {signal_name} at step 7: checkpoint 7 is committed in "
                             f"{tmp_path / 'w' / 'checkpoints'}; rerun the same command to resume"]
  assert checkpoints(tmp_path / "w") == [7]
  rc, out, err = finish(command(args(sample_tokens=0)))
  assert rc == 0 and "at step 7" in err.split("resumed from ")[1].splitlines()[0], err[-3000:]
  assert json.loads(out)["step"] == 40


@pytest.mark.slow
def test_a_second_signal_stops_at_once(args, tmp_path):
  """Two SIGTERMs at step 5: no checkpoint is waited for (none is due before 10), the one line
  says so, status 75; the rerun starts over and finishes."""
  rc, out, err = finish(command(args(sample_tokens=0), ["SIGTERM*2@step", "5"]))
  assert rc == exit_codes.PREEMPTED and out == "", err[-3000:]
  assert stop_lines(err) == ["error: a second signal (SIGTERM) while training: stopped at once; "
                             "anything being written was left unfinished (never renamed into "
                             "place); rerun the same command"]
  assert checkpoints(tmp_path / "w") == []
  rc, _, err = finish(command(args(sample_tokens=0)))
  assert rc == 0, err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("fault, line", [
    (["SIGTERM@commit", "1"], "stopped by SIGTERM at step 40: checkpoint 40 is committed"),
    (["SIGTERM@sample", "1"], "stopped by SIGTERM while sampling: nothing was left half-written"),
], ids=["final commit", "sample"])
def test_a_stop_at_the_end_waits_for_the_final_checkpoint(args, tmp_path, fault, line):
  """SIGTERM while the final checkpoint is committed, or during the end-of-run sample: the
  checkpoint is committed first, status 75; the rerun evaluates it and samples."""
  rc, out, err = finish(command(args(), fault))
  assert rc == exit_codes.PREEMPTED and out == "", err[-3000:]
  lines = stop_lines(err)
  assert len(lines) == 1 and lines[0].startswith(line), lines
  assert 40 in checkpoints(tmp_path / "w")
  rc, out, err = finish(command(args()))
  assert rc == 0 and "sample:" in err and json.loads(out)["step"] == 40, err[-3000:]


@pytest.mark.slow
def test_a_background_job_stops_on_sigint(args, tmp_path):
  """A job started with SIGINT ignored (as a shell starts `cmd &` from a script) still stops on
  `kill -INT`, at a step, with a checkpoint."""
  process = command(args(num_steps=100000, checkpoint_every=100000, eval_every=100000,
                         sample_tokens=0),
                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
  deadline = time.time() + 240
  while not (os.path.isfile(tmp_path / "w" / "metrics.jsonl") and metrics(tmp_path / "w")):
    assert process.poll() is None and time.time() < deadline, process.communicate()[1][-3000:]
    time.sleep(0.1)
  process.send_signal(signal.SIGINT)
  rc, _, err = finish(process, timeout=60)
  assert rc == exit_codes.INTERRUPTED, err[-3000:]
  step = int(stop_lines(err)[0].split(" at step ")[1].split(":")[0])
  assert checkpoints(tmp_path / "w") == [step]


@pytest.mark.slow
@pytest.mark.parametrize("module, fault", [("evaluate", ["SIGTERM@evaluate", "1"]),
                                           ("sample", ["SIGINT@generate", "1"])])
def test_evaluation_and_sampling_stop_with_one_line(args, tmp_path, module, fault):
  """The other commands: SIGTERM is 143 there (not a training run), SIGINT 130; one line each."""
  rc, _, err = finish(command(args(num_steps=4, checkpoint_every=4, eval_every=4,
                                   sample_tokens=0)))
  assert rc == 0, err[-3000:]
  rc, out, err = finish(command([f"--workdir={tmp_path / 'w'}"], fault, module=module))
  signal_name = fault[0].split("@")[0]
  assert rc == (exit_codes.TERMINATED if signal_name == "SIGTERM" else exit_codes.INTERRUPTED)
  # The line names the innermost phase running (evaluate's scoring is a phase of its own).
  phases = {"evaluate": (f"evaluating {tmp_path / 'w'}",
                         f"scoring {tmp_path / 'w'} on its eval split"),
            "sample": (f"sampling from {tmp_path / 'w'}",)}[module]
  assert out == "" and stop_lines(err) in [
      [f"stopped by {signal_name} while {phase}; rerun the same command"] for phase in phases], err


def _wikitext_zip() -> bytes:
  """A wikitext-103-raw-v1.zip of fixture text: three splits of headed articles."""
  buffer = io.BytesIO()
  with zipfile.ZipFile(buffer, "w") as zf:
    for split, n in (("train", 12), ("valid", 3), ("test", 3)):
      articles = [f" = Article {split} {i} = \n \n{fake_work_text(f'{split}{i}', 80)}\n"
                  for i in range(n)]
      zf.writestr(f"wikitext-103-raw/wiki.{split}.raw", "".join(articles).encode())
  return buffer.getvalue()


class _Mirror(http.server.BaseHTTPRequestHandler):
  """Serves the archive; while `stall` is set it sends the first kilobyte and then waits."""
  payload = b""
  stall = threading.Event()

  def do_GET(self):  # pylint: disable=invalid-name
    self.send_response(200)
    self.send_header("Content-Length", str(len(self.payload)))
    self.end_headers()
    if self.stall.is_set():
      self.wfile.write(self.payload[:1024])
      self.wfile.flush()
      time.sleep(60)  # (the client gives up first: it is stopped)
      return
    self.wfile.write(self.payload)

  def log_message(self, *args):  # pylint: disable=arguments-differ
    pass


@pytest.mark.slow  # a download stalled, stopped, then completed; a tokenizer and a run
def test_a_stop_during_a_download_leaves_no_partial_archive(args, tmp_path):
  """Ctrl-C while the wikitext103 archive downloads (from a local mirror that stalls after its
  first kilobyte): exit 130 within 10 s, one line, no `.part` file; then the same command, the
  mirror answering, downloads, prepares and trains."""
  _Mirror.payload = _wikitext_zip()
  _Mirror.stall.set()
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Mirror)
  server.daemon_threads = True
  threading.Thread(target=server.serve_forever, daemon=True).start()
  url = f"http://127.0.0.1:{server.server_address[1]}/wikitext-103-raw-v1.zip"
  run = args(fresh_data=True, num_steps=4, checkpoint_every=4, eval_every=4, sample_tokens=0) + [
      "--config.data.dataset=wikitext103", "--config.data.archive=",
      f"--config.data.archive_sha256={hashlib.sha256(_Mirror.payload).hexdigest()}"]
  try:
    log = open(tmp_path / "stderr.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "tests/inject_fault.py", f"wikitext-from:{url}", "0", *run], cwd=REPO,
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.time() + 240
    while f"downloading {url}" not in open(log.name).read():
      assert process.poll() is None and time.time() < deadline, open(log.name).read()[-3000:]
      time.sleep(0.2)
    time.sleep(1.0)  # the first kilobyte is written, the rest is not coming
    start = time.time()
    process.send_signal(signal.SIGINT)
    out, _ = process.communicate(timeout=60)
    err = open(log.name).read()
    assert process.returncode == exit_codes.INTERRUPTED, err[-3000:]
    assert time.time() - start < 10 and out == ""
    lines = stop_lines(err)
    assert lines == [lines[0]] and lines[0].startswith(f"stopped by SIGINT while downloading {url}")
    assert leftovers(tmp_path / "data") == []
    _Mirror.stall.clear()
    rc, out, err = finish(command(run, [f"wikitext-from:{url}", "0"]))
    assert rc == 0, err[-3000:]
    assert json.loads(out)["step"] == 4 and leftovers(tmp_path / "data") == []
  finally:
    server.shutdown()
