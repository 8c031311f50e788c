"""Many processes, one job: `jax.distributed` set-up, the primary process, barriers.

Every process (one per host, or one per GPU) runs the same command; after
`initialize_distributed` they are one JAX program over all their devices. Process 0
is the primary: it alone writes metrics, logs progress and writes the workdir's
`config.json` and `tokenizer.model`. Everything collective (training and eval steps,
the sample, Orbax checkpoints) runs on every process, or the job hangs.

A stop signal reaching any process stops all of them at the same step (`StopAgreement`); what
the processes must agree on (the checkpoint to restore, the corpus) is gathered from all of them
(`allgather_ints`, `processes_differing`).

A process that dies (or whose host stops answering) ends every other one with one `error:` line
naming it and the last committed checkpoint, and exit status `exit_codes.PROCESS_LOST`, within
the coordination service's heartbeat timeout (`PeerWatch`). For that the job runs with JAX's
recoverable tasks, so that the service reports a lost process instead of aborting every other
one natively; the processes then leave the service together at exit (`leave`), which its
shutdown barrier no longer does for them. (If process 0 itself dies, the service dies with it
and the others end with JAX's own message.)
"""

import atexit

import glob
import hashlib
import importlib.util
import logging
import os
import threading
import time
from typing import Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from efficient_lm.config.errors import ConfigError
from efficient_lm.runtime import exit_codes
from efficient_lm.runtime import jax_compat
from efficient_lm.runtime import jax_devices
from efficient_lm.runtime import signals

log = logging.getLogger(__name__)

T = TypeVar("T")

# Our own fallbacks for the three flags (JAX reads only JAX_COORDINATOR_ADDRESS itself).
ENV_FLAGS = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
             "process_id": "JAX_PROCESS_ID"}


def _env_int(name: str) -> int | None:
  value = os.environ.get(name, "").strip()
  return int(value) if value.isdigit() else None


def cluster_environment() -> str | None:
  """The multi-process launcher this process runs under, from the environment; None if none.

  Only launchers that `jax.distributed.initialize()` configures by itself count, and
  only when they started more than one process (a one-task SLURM job is a plain run).
  """
  if "SLURM_STEP_NODELIST" in os.environ and "SLURM_PROCID" in os.environ and (
      (_env_int("SLURM_NTASKS") or 1) > 1):
    return "SLURM"
  if "OMPI_MCA_orte_hnp_uri" in os.environ and (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
    return "Open MPI"
  hosts = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get("TPU_WORKER_HOSTNAMES") or ""
  tpu_chips = glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*")
  if "," in hosts or (tpu_chips and importlib.util.find_spec("libtpu") is not None):
    return "Cloud TPU"  # a TPU VM: JAX asks the metadata server how many workers the slice has
  return None


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, heartbeat_timeout: int = 100) -> bool:
  """Joins this process to a multi-process job; returns whether it did (False: a plain single process).

  Missing arguments come from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID,
  then from the cluster (SLURM, Open MPI, Cloud TPU), which `jax.distributed.initialize`
  detects; under SLURM or Open MPI that detection also gives each process one local device
  (one process per GPU), while all three given explicitly leave every local device to the
  process (one process per host). Must run before anything touches devices. Sets gloo as the
  CPU backend's cross-process collectives (it affects only the CPU client: harmless on GPU/TPU).
  `heartbeat_timeout`: seconds of silence after which a process counts as lost (JAX's default).
  """
  if jax.distributed.is_initialized():
    return True
  coordinator_address = coordinator_address or os.environ.get(ENV_FLAGS["coordinator_address"]) or None
  if num_processes is None:
    num_processes = _env_int(ENV_FLAGS["num_processes"])
  if process_id is None:
    process_id = _env_int(ENV_FLAGS["process_id"])
  given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
           "process_id": process_id}
  cluster = cluster_environment()
  if cluster is None:
    if all(v is None for v in given.values()) or (num_processes == 1 and coordinator_address is None):
      return False
    missing = [f"--{k}" for k, v in given.items() if v is None]
    if missing:
      raise ConfigError(
          f"{', '.join(missing)} missing: with no cluster launcher (SLURM, Open MPI, Cloud TPU) in the "
          "environment, a multi-process run needs --coordinator_address=HOST:PORT, --num_processes=N "
          "and --process_id=I (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); pass "
          "all three, or none for a single process")
  if num_processes is not None and (num_processes < 1 or (
      process_id is not None and not 0 <= process_id < num_processes)):
    raise ConfigError(f"--process_id={process_id} must be in [0, --num_processes={num_processes}); "
                      "give each process its own id from 0 to num_processes - 1")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # Stop signals are ours (`StopAgreement`): JAX's preemption service would take SIGTERM over.
  jax.config.update("jax_enable_preemption_service", False)
  # A lost process is reported by `PeerWatch`, not by a native abort of every other process.
  jax.config.update("jax_enable_recoverability", True)
  # All three given: take them as they are. (JAX's cluster detection would otherwise also pin a
  # SLURM or Open MPI process to one local device, its local rank: one process per GPU.)
  explicit = all(v is not None for v in given.values())
  error = None
  with jax_devices.native_stderr_captured() as captured:  # the service's "experimental" warning
    try:
      jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                 cluster_detection_method="deactivate" if explicit else None,
                                 heartbeat_timeout_seconds=heartbeat_timeout)
    except BaseException as e:  # pylint: disable=broad-except  (re-raised with what it printed)
      error = e
    text = captured()
  if error is not None:
    jax_devices.replay(text)
    raise error
  signals.install()  # again: nothing native keeps SIGINT / SIGTERM
  PeerWatch.start(heartbeat_timeout)
  atexit.register(leave)  # (after jax's own exit hook is registered: runs before it)
  signals.before_exit(leave)
  return True


class PeerWatch(threading.Thread):
  """Asks the coordination service, over and over, which processes of the job are alive (a
  barrier-like call: it returns once every live process asked too, or once a silent one passed
  the heartbeat timeout). A process missing from the answer ends this one: one `error:` line
  naming it and the last committed checkpoint (`describe_checkpoints`), exit status
  `exit_codes.PROCESS_LOST`."""

  instance: "PeerWatch | None" = None
  describe_checkpoints: Callable[[], str] = staticmethod(lambda: "no checkpoint was written yet")

  def __init__(self, heartbeat_timeout: int):
    super().__init__(name="efficient_lm: peer watch", daemon=True)
    self.heartbeat_timeout = heartbeat_timeout
    self.leaving = threading.Event()
    self.lost = threading.Event()

  @classmethod
  def start(cls, heartbeat_timeout: int) -> None:  # pylint: disable=arguments-differ
    cls.instance = cls(heartbeat_timeout)
    threading.Thread.start(cls.instance)

  def run(self) -> None:
    client = jax_compat.distributed_client()
    if client is None:  # no coordination service to ask
      return
    everyone = list(range(jax.process_count()))
    while not self.leaving.is_set():
      try:
        live = set(client.get_live_nodes(everyone))
      except Exception:  # pylint: disable=broad-except  (the service is unreachable)
        live = {jax.process_index()}
      missing = sorted(set(everyone) - live)
      if missing and not self.leaving.is_set():
        self.lost.set()
        if is_primary():  # the service lives here: give the others a moment to say it too
          time.sleep(2.0)
        signals.exit_now(exit_codes.PROCESS_LOST, f"error: {lost_line(missing)}")
      self.leaving.wait(2.0)

  @classmethod
  def explain(cls, error: BaseException) -> None:
    """After `error` in a multi-process job: if it is a failed exchange with another process (a
    collective, a barrier), the time the watch needs to name a lost process (it then ends this
    one); returns otherwise, or if it names none."""
    text = str(error)
    if cls.instance is not None and any(s in text for s in _LOST_PEER_SIGNS):
      log.warning("an exchange with another process failed (%s); waiting up to %d s for the "
                  "coordination service to say which process is gone", text.splitlines()[0][:200],
                  cls.instance.heartbeat_timeout + 10)
      if cls.instance.lost.wait(cls.instance.heartbeat_timeout + 10):
        threading.Event().wait()  # the watch is ending the process with its line


# What a collective or barrier failing because another process is gone says (gloo, gRPC).
_LOST_PEER_SIGNS = ("Gloo", "Connection closed", "Connection reset", "UNAVAILABLE",
                    "heartbeat", "DEADLINE_EXCEEDED", "Barrier")


def lost_line(missing: list[int]) -> str:
  who = ", ".join(str(i) for i in missing)
  return (f"process {who} of the job stopped answering (it died, was killed, or its host is "
          f"unreachable), so this process (process {jax.process_index()}) stops too; "
          f"{PeerWatch.describe_checkpoints()}; rerun the same command on every host to resume")


def leave(timeout: float = 30.0) -> None:
  """The job's processes leave the coordination service together (at exit, normal or not): a
  barrier, then process 0, which hosts the service, waits until the others have disconnected, so
  that none loses the service in the middle of its own exit. Waits at most `timeout` seconds."""
  watch = PeerWatch.instance
  if watch is None or watch.leaving.is_set() or watch.lost.is_set():
    return
  watch.leaving.set()
  client = jax_compat.distributed_client()
  if client is None:
    return
  try:
    client.wait_at_barrier("efficient_lm: leaving", int(timeout * 1000))
  except Exception:  # pylint: disable=broad-except  (a process is missing: leave anyway)
    pass
  if not is_primary():
    jax.distributed.shutdown()
    return
  others = [i for i in range(jax.process_count()) if i != 0]

  def wait_for_others() -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      try:
        if not set(others) & set(client.get_live_nodes(list(range(jax.process_count())))):
          return
      except Exception:  # pylint: disable=broad-except
        return
      time.sleep(0.05)

  waiter = threading.Thread(target=wait_for_others, daemon=True)
  waiter.start()
  waiter.join(timeout)


def log_job() -> None:
  """One line: the job's processes and devices (process 0 logs it)."""
  log.info("one job of %d processes over %d devices (%d here)", jax.process_count(),
           jax.device_count(), jax.local_device_count())


def is_primary() -> bool:
  """Process 0: the one that writes metrics, logs and the workdir's shared files."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process reaches `name` (a no-op for one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"efficient_lm: {name}")


def allgather_ints(values) -> np.ndarray:
  """`[process_count, n]`: every process's `values` (n int64 each, the same n everywhere), on every
  process (collective)."""
  local = np.asarray(values, np.int64).reshape(-1)
  if jax.process_count() == 1:
    return local[None]
  return np.asarray(multihost_utils.process_allgather(local)).reshape(jax.process_count(), -1)


def processes_differing(value: str) -> list[int]:
  """The processes whose `value` differs from process 0's (collective; [] with one process)."""
  digest = np.frombuffer(hashlib.sha256(value.encode()).digest(), np.uint8).astype(np.int64)
  gathered = allgather_ints(digest)
  return [i for i in range(1, len(gathered)) if not np.array_equal(gathered[i], gathered[0])]


class StopAgreement:
  """Whether a stop signal reached any process of the job, agreed by all at the same call.

  Every process calls `poll(signals.requested())` at the same points (after every train step,
  between evaluation batches). One process: its own request, at once. Several: each call starts a
  one-integer max-reduction over every device, asynchronous (it runs behind the step just
  dispatched), and returns the previous call's result: every process sees the stop at the same
  call, one step after the signal reached any of them, for the price of one scalar all-reduce a
  step. The result names the strongest signal any process received (SIGINT over SIGTERM).
  """

  _CODES = {None: 0, "SIGTERM": 1, "SIGINT": 2}
  _NAMES = {code: name for name, code in _CODES.items()}

  def __init__(self):
    self._pending = None
    self.signal: str | None = None  # what the job stops for, once a poll said so
    if jax.process_count() > 1:
      mesh = jax.sharding.Mesh(np.array(jax.devices()), ("processes",))
      self._sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("processes"))
      self._reduce = jax.jit(jnp.max, out_shardings=jax.sharding.NamedSharding(
          mesh, jax.sharding.PartitionSpec()))

  def poll(self, requested: str | None) -> str | None:
    """The signal the job stops for (the same on every process at this call), or None."""
    if jax.process_count() == 1:
      agreed = requested
    else:
      code = np.array([self._CODES.get(requested, 1)], np.int32)
      shards = [jax.device_put(code, d) for d in self._sharding.addressable_devices_indices_map(
          (jax.device_count(),))]
      flags = jax.make_array_from_single_device_arrays((jax.device_count(),), self._sharding,
                                                       shards)
      pending, self._pending = self._pending, self._reduce(flags)
      agreed = None if pending is None else self._NAMES[
          int(np.asarray(pending.addressable_data(0)))]
    if agreed is not None:
      self.signal = agreed
    return agreed

  def settle(self, requested: str | None) -> str | None:
    """`poll`, but up to date: a request made since the last poll counts (two polls with
    several processes; blocking)."""
    return self.poll(requested) or (self.poll(requested) if jax.process_count() > 1 else None)


def primary_first(fn: Callable[[], T], name: str, others: Callable[[], T] | None = None) -> T:
  """`fn()` on process 0, then (after a barrier) on the others, or `others()` there: shared files
  are made once, never raced, and what only process 0 need do (read a whole corpus, train a
  tokenizer) is done once.

  Process 0 reaches the barrier even when `fn` fails (then re-raises), so the others
  run `fn` themselves and report the same error instead of waiting forever.
  """
  if jax.process_count() == 1:
    return fn()
  result, error = None, None
  if is_primary():
    try:
      result = fn()
    except Exception as e:  # pylint: disable=broad-except  (re-raised after the barrier)
      error = e
  barrier(name)
  if error is not None:
    raise error
  if is_primary():
    return result
  return (others or fn)()
