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
one that every process sees (a shared filesystem or a bucket).
"""

import logging
import os
import shutil
from typing import Any, Callable

import orbax.checkpoint as ocp

from efficient_lm import distributed

log = logging.getLogger(__name__)


class NoRestorableCheckpointError(RuntimeError):
  """Every checkpoint in the directory failed to restore."""


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
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, Any]:
    """Returns (state, data_state) of checkpoint `step`, shaped like `abstract_state`."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore()))
    return restored.state, restored.data

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
    """
    steps = sorted(self.all_steps(), reverse=True)
    unreadable = []
    for i, step in enumerate(steps):
      try:
        meta = self.restore_meta(step)
      except Exception as e:  # pylint: disable=broad-except  (any unreadable file)
        unreadable.append((step, e))
      else:
        check_meta(meta)
        try:
          state, data_state = self.restore(step, abstract_state)
        except Exception as e:  # pylint: disable=broad-except
          unreadable.append((step, e))
        else:
          if set_aside:
            self._set_aside([s for s, _ in unreadable])
          return step, state, data_state
      following = f"falling back to step {steps[i + 1]}" if i + 1 < len(steps) else "no older one"
      log.warning("checkpoint %d is corrupt or unreadable (%s: %s); %s", step,
                  type(unreadable[-1][1]).__name__, str(unreadable[-1][1]).splitlines()[0][:200],
                  following)
    if unreadable:
      raise NoRestorableCheckpointError(
          f"no checkpoint in {self.directory} can be restored (steps "
          f"{', '.join(str(s) for s, _ in unreadable)} are corrupt or unreadable); nothing was "
          f"overwritten. To start fresh, move or delete {self.directory}, or use another --workdir")
    return None

  def _set_aside(self, steps: list[int]) -> None:
    if not steps:
      return
    aside = self.directory + "_unreadable"
    if distributed.is_primary():  # one process moves; the others wait for it, then re-read
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
