"""Trains a model: `python -m efficient_lm.main --config=configs/<name>.py[:preset] [--workdir=DIR]`.

Any config field can be overridden, e.g. `--config.train.num_steps=100`.
`--workdir` defaults to `runs/<config name>[_<preset>]`; a run resumes from the
latest checkpoint in its workdir.
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

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


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  logging.use_absl_handler()
  workdir = FLAGS.workdir or default_workdir(FLAGS["config"].config_filename)
  try:
    train.train_and_evaluate(FLAGS.config, workdir)
  except (ConfigError, train.WorkdirMismatchError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main)
