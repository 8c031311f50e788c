"""Every use of Orbax, in one place.

A checkpoint at `<workdir>/checkpoints/<step>` holds three items:
`state` (parameters, optimizer state and step: a pytree of arrays),
`data` (the data iterator's state, JSON) and `meta` (JSON: what the model is,
so a mismatched config can be refused before restoring). Writes are atomic:
Orbax writes to a temporary directory and renames it when complete.
"""

import os
from typing import Any

import orbax.checkpoint as ocp


class Checkpointer:
  """Saves and restores training state under `directory`, keeping the newest `max_to_keep`."""

  def __init__(self, directory: str, *, max_to_keep: int):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False)
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
    self._manager.wait_until_finished()

  def restore_meta(self, step: int) -> dict:
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, Any]:
    """Returns (state, data_state) of checkpoint `step`, shaped like `abstract_state`."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore()))
    return restored.state, restored.data

  def close(self) -> None:
    self._manager.close()
