"""Weights & Biases logging (`train.wandb=True`): the figures `metrics.jsonl` gets and the config.

The run's id is kept in `<workdir>/wandb_run_id`, so a resumed training run logs to the same W&B
run (`resume="allow"`). `WANDB_MODE=offline` writes the run under `$WANDB_DIR/wandb/` (default:
the workdir) for a later `wandb sync`. Imported only when `train.wandb` is on.
"""

import json
import logging
import os

from efficient_lm.config.errors import ConfigError
from efficient_lm.config.run import RunConfig
from efficient_lm.config.train import TrainConfig
from efficient_lm.runtime import figures

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"
EXTRA = "pip install -e '.[wandb]'"


def check(t: TrainConfig) -> None:
  """The wandb package when `train.wandb` is on (before anything compiles; the `train.wandb*`
  fields' own checks ran as the section was built): a ConfigError naming the field and the
  fix."""
  if t.wandb:
    check_installed()


def check_installed() -> None:
  """The wandb package, which `train.wandb=True` needs: a ConfigError naming the field and the
  fix."""
  try:
    import wandb  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    raise ConfigError(f"train.wandb=True needs the wandb package ({e}); install the extra with "
                      f"{EXTRA}, or set train.wandb=False") from None


def tags(spec: str) -> list[str]:
  """'a, b,,c' -> ['a', 'b', 'c']."""
  return [tag.strip() for tag in spec.split(",") if tag.strip()]


def run_id(workdir: str) -> str:
  """The workdir's W&B run id: the one stored there, else a new one, stored (atomically)."""
  path = os.path.join(workdir, RUN_ID_FILE)
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      stored = f.read().strip()
    if stored:
      return stored
  from wandb.sdk.lib import runid  # pylint: disable=import-outside-toplevel
  new = runid.generate_id()
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(new + "\n")
  os.replace(tmp, path)
  return new


class WandbWriter:
  """Sends each `write(step, metrics)` to a W&B run at that step; `close` finishes the run."""

  def __init__(self, run: RunConfig, workdir: str):
    import wandb  # pylint: disable=import-outside-toplevel
    t = run.train
    ident = run_id(workdir)
    try:
      self._run = wandb.init(
          project=t.wandb_project, name=t.wandb_run_name or None, tags=tags(t.wandb_tags),
          id=ident, resume="allow", config=json.loads(run.to_json()),
          dir=None if os.environ.get("WANDB_DIR") else workdir,
          settings=wandb.Settings(console="off", silent=True))
    except Exception as e:  # pylint: disable=broad-except  (no login, no network, a bad project)
      first = (str(e).splitlines() or [type(e).__name__])[0]
      raise ConfigError(f"train.wandb=True: W&B could not start run {ident} ({first}); run "
                        "`wandb login`, or set WANDB_MODE=offline, or train.wandb=False") from None
    folder = os.path.dirname(self._run.dir)
    log.info("logging to W&B run %s (%s)", ident, self._run.url or
             f"offline, in {folder}; upload it with `wandb sync {folder}`")

  def write(self, step: int, metrics: dict) -> None:
    self._run.log(figures.numbers(metrics), step=int(step))  # (a null figure is left out)

  def close(self) -> None:
    self._run.finish()
