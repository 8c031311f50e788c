"""Many processes, one job: `jax.distributed` set-up, the primary process, barriers.

Every process (one per host, or one per GPU) runs the same command; after
`initialize_distributed` they are one JAX program over all their devices. Process 0
is the primary: it alone writes metrics, logs progress and writes the workdir's
`config.json` and `tokenizer.model`. Everything collective (training and eval steps,
the sample, Orbax checkpoints) runs on every process, or the job hangs.
"""

import glob
import importlib.util
import os
from typing import Callable, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from efficient_lm.validation import ConfigError

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
                           process_id: int | None = None) -> bool:
  """Joins this process to a multi-process job; returns whether it did (False: a plain single process).

  Missing arguments come from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID,
  then from the cluster (SLURM, Open MPI, Cloud TPU), which `jax.distributed.initialize`
  detects; under SLURM or Open MPI that detection also gives each process one local device
  (one process per GPU), while all three given explicitly leave every local device to the
  process (one process per host). Must run before anything touches devices. Sets gloo as the
  CPU backend's cross-process collectives (it affects only the CPU client: harmless on GPU/TPU).
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
  # All three given: take them as they are. (JAX's cluster detection would otherwise also pin a
  # SLURM or Open MPI process to one local device, its local rank: one process per GPU.)
  explicit = all(v is not None for v in given.values())
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             cluster_detection_method="deactivate" if explicit else None)
  return True


def is_primary() -> bool:
  """Process 0: the one that writes metrics, logs and the workdir's shared files."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process reaches `name` (a no-op for one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"efficient_lm: {name}")


def any_process(flag: bool) -> bool:
  """True on every process if `flag` is true on any (collective: every process must call it)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


def primary_first(fn: Callable[[], T], name: str) -> T:
  """`fn()` on process 0, then (after a barrier) on the others: shared files are made once, never raced.

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
  return result if is_primary() else fn()
