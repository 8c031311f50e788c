"""Every use of Orbax, in one place.

Saves are asynchronous: `save` returns once the arrays are copied off the devices, and Orbax
writes them in a background thread while training goes on. A save is complete only once Orbax has
committed it (written into a temporary directory, then renamed): a kill during the write loses that
save only, never an earlier one. `wait` blocks until the save in flight is committed (a
preemption, the end of the run, before any restore).

A checkpoint at `<workdir>/checkpoints/<step>` holds three items:
`state` (parameters, optimizer state and step: a pytree of arrays),
`data` (the data iterator's state, JSON) and `meta` (JSON: what the model is,
so a mismatched config can be refused before restoring). Writes are atomic:
Orbax writes to a temporary directory and renames it when complete.

With several processes every one calls save and restore (Orbax coordinates them
with barriers: each process writes the array shards it holds, a replicated array
once, and process 0 the JSON items and the final rename); the directory must be
one that every process sees (a shared filesystem or a bucket). Before restoring, the processes
agree on the step: each checks which checkpoints it can read, the lists are gathered, and every
process restores the newest step all of them can read (and sets aside the same newer ones).
"""

import json
import logging
import os
import shutil
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from efficient_lm.parallel import distributed

log = logging.getLogger(__name__)
AGREED_STEPS = 64  # the newest checkpoints the processes compare before a restore


def committed_steps(directory: str) -> list[int]:
  """The steps committed under `directory` (Orbax renames a checkpoint to its step once complete),
  ascending; read from the directory alone, without Orbax."""
  try:
    names = os.listdir(directory)
  except OSError:
    return []
  return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def describe_committed(directory: str) -> str:
  """'the last committed checkpoint is step N in DIR' (or that there is none yet)."""
  steps = committed_steps(directory)
  if not steps:
    return f"no checkpoint is committed in {directory} yet"
  return f"the last committed checkpoint is step {steps[-1]} in {directory}"


def read_item(directory: str, step: int, item: str) -> Any:
  """A JSON item (`meta`, `data`) of checkpoint `step`, read from its file (no Orbax, no barrier)."""
  with open(os.path.join(directory, str(step), item, "metadata"), encoding="utf-8") as f:
    return json.load(f)


def latest_meta(directory: str) -> dict | None:
  """The `meta` item of the newest committed checkpoint, or None if there is none or it cannot
  be read (the restore then decides)."""
  steps = committed_steps(directory)
  if not steps:
    return None
  try:
    return read_item(directory, steps[-1], "meta")
  except (OSError, ValueError):
    return None


def unreadable_reason(directory: str, step: int) -> str | None:
  """Why checkpoint `step` cannot be restored, seen from this process, or None if it looks whole:
  its JSON items and the state's metadata parse and none of its files is empty (what a truncated
  or half-copied checkpoint shows). Reads no array data."""
  folder = os.path.join(directory, str(step))
  try:
    for item in ("meta", "data"):
      read_item(directory, step, item)
    with open(os.path.join(folder, "state", "_METADATA"), encoding="utf-8") as f:
      json.load(f)
    for root, _, files in os.walk(folder):
      for name in files:
        if os.path.getsize(os.path.join(root, name)) == 0:
          return f"{os.path.relpath(os.path.join(root, name), folder)} is empty"
  except (OSError, ValueError) as e:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
  return None


class NoRestorableCheckpointError(RuntimeError):
  """Every checkpoint in the directory failed to restore."""


class CheckpointRestoreError(RuntimeError):
  """A checkpoint every process found readable failed to restore on this one (several processes:
  no fallback in step with the others)."""


class Checkpointer:
  """Saves and restores training state under `directory`, keeping the newest `max_to_keep`."""

  def __init__(self, directory: str, *, max_to_keep: int | None, asynchronous: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=asynchronous)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "data", "meta"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, data_state: Any, meta: dict) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta)), force=True)

  def wait(self) -> None:
    """Blocks until the save in flight (if any) is committed."""
    self._manager.wait_until_finished()

  def restore_meta(self, step: int) -> dict:
    self.wait()
    return read_item(self.directory, step, "meta")

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, Any]:
    """Returns (state, data_state) of checkpoint `step`, shaped like `abstract_state`."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore()))
    return restored.state, restored.data

  def agreed_steps(self) -> tuple[list[int], dict[int, str]]:
    """(the steps every process can read, newest first; {newer step: why it cannot be read}).

    Each process checks the newest `AGREED_STEPS` checkpoints it lists (`unreadable_reason`); with
    several processes the lists are gathered, so every process gets the same answer."""
    self.wait()
    listed = sorted(self.all_steps(), reverse=True)[:AGREED_STEPS]
    reasons = {step: unreadable_reason(self.directory, step) for step in listed}
    if jax.process_count() == 1:
      readable = [step for step in listed if reasons[step] is None]
      return readable, {step: reasons[step] for step in listed if reasons[step] is not None}
    rows = np.full((2, AGREED_STEPS), -1, np.int64)
    rows[0, :len(listed)] = listed
    rows[1, :len(listed)] = [step if reasons[step] is None else -1 for step in listed]
    gathered = distributed.allgather_ints(rows).reshape(jax.process_count(), 2, AGREED_STEPS)
    every = set.intersection(*(set(g[1][g[1] >= 0].tolist()) for g in gathered))
    union = set().union(*(set(g[0][g[0] >= 0].tolist()) for g in gathered))
    unreadable = {}
    for step in sorted(union - every, reverse=True):
      where = [i for i, g in enumerate(gathered) if step not in set(g[1].tolist())]
      unreadable[step] = reasons.get(step) or (
          f"not readable on process(es) {', '.join(map(str, where))}")
    return sorted(every, reverse=True), unreadable

  def restore_latest(self, abstract_state: Any, check_meta: Callable[[dict], None], *,
                     set_aside: bool = True) -> tuple[int, Any, Any] | None:
    """(step, state, data_state) of the newest checkpoint that restores; None if there is none.

    `check_meta(meta)` runs before the state is read and may raise (a config
    whose model differs); that error propagates. A checkpoint that cannot be
    read (truncated or missing files) is reported in one line and the next
    older one is tried; unreadable checkpoints newer than the one restored are
    moved to `<directory>_unreadable/` (kept, never deleted) so that training
    can write those steps again (`set_aside=False`, for readers such as the
    sampler, leaves them in place). If none restores, nothing is moved and
    NoRestorableCheckpointError says how to start fresh.

    With several processes the step is agreed first (`agreed_steps`): all restore the same step
    and set aside the same newer ones. A restore that fails on one process after that agreement
    cannot be retried in step with the others (Orbax waits for every process at a barrier): it
    stops with CheckpointRestoreError, naming the checkpoint to move aside.
    """
    readable, unreadable = self.agreed_steps()
    skipped = []
    for step in readable:
      for bad in sorted((s for s in unreadable if s > step and s not in skipped), reverse=True):
        log.warning("checkpoint %d is corrupt or unreadable (%s); falling back to step %d", bad,
                    unreadable[bad], step)
        skipped.append(bad)
      check_meta(self.restore_meta(step))
      try:
        state, data_state = self.restore(step, abstract_state)
      except Exception as e:  # pylint: disable=broad-except  (any unreadable file)
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if jax.process_count() > 1:
          raise CheckpointRestoreError(
              f"checkpoint {step} in {self.directory} passed every process's check but process "
              f"{jax.process_index()} could not restore it ({reason}); the other processes wait "
              f"for it in Orbax's barrier. Move {os.path.join(self.directory, str(step))} to "
              f"{self.directory}_unreadable/ and rerun the same command") from e
        unreadable[step] = reason
        continue
      if set_aside:
        self._set_aside(sorted(s for s in unreadable if s > step))
      return step, state, data_state
    for bad in sorted((s for s in unreadable if s not in skipped), reverse=True):
      log.warning("checkpoint %d is corrupt or unreadable (%s); no older one", bad, unreadable[bad])
    if unreadable:
      raise NoRestorableCheckpointError(
          f"no checkpoint in {self.directory} can be restored (steps "
          f"{', '.join(str(s) for s in sorted(unreadable, reverse=True))} are corrupt or "
          f"unreadable); nothing was overwritten. To start fresh, move or delete {self.directory}, "
          "or use another --workdir")
    return None

  def _set_aside(self, steps: list[int]) -> None:
    if not steps:
      return
    aside = self.directory + "_unreadable"
    if distributed.is_primary():  # one process moves; every process waits for it, then re-reads
      os.makedirs(aside, exist_ok=True)
      for step in steps:
        target = os.path.join(aside, str(step))
        if os.path.exists(target):
          shutil.rmtree(target)
        shutil.move(os.path.join(self.directory, str(step)), target)
        log.warning("moved unreadable checkpoint %d to %s", step, target)
    distributed.barrier(f"set aside checkpoints {steps}")
    self._manager.reload()

  def close(self) -> None:
    self.wait()
    self._manager.close()
