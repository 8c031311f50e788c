"""Trains a model: `python -m efficient_lm.main --config=configs/<name>.py[:preset] [--workdir=DIR]`.

Any config field can be overridden, e.g. `--config.train.num_steps=100`.
`--workdir` defaults to `runs/<config name>[_<preset>]`; a run resumes from the
latest checkpoint in its workdir.
"""

import logging as std_logging
import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from efficient_lm import checkpoint
from efficient_lm import data
from efficient_lm import train
from efficient_lm.validation import ConfigError

config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/dense.py or configs/bcmt.py:128.",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs; default runs/<config name>.")
flags.mark_flags_as_required(["config"])
FLAGS = flags.FLAGS


def default_workdir(config_arg: str) -> str:
  path, _, preset = config_arg.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  return os.path.join("runs", f"{name}_{preset}" if preset else name)


def setup_logging() -> None:
  """Our progress at INFO on stderr; the libraries' (Orbax, TFDS) warnings only."""
  logging.set_verbosity(logging.WARNING)
  handler = std_logging.StreamHandler(sys.stderr)
  handler.setFormatter(std_logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
  ours = std_logging.getLogger("efficient_lm")
  ours.handlers = [handler]
  ours.setLevel(std_logging.INFO)
  ours.propagate = False


def main(argv):
  del argv
  setup_logging()
  workdir = FLAGS.workdir or default_workdir(FLAGS["config"].config_filename)
  try:
    train.train_and_evaluate(FLAGS.config, workdir)
  except (ConfigError, data.DataError, data.DownloadError, train.WorkdirMismatchError,
          checkpoint.NoRestorableCheckpointError, train.NonFiniteError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main)
