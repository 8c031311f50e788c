"""Trains a model: `python -m efficient_lm.main --config=configs/<name>.py[:preset] [--workdir=DIR]`.

The command's flags and body: `efficient_lm/cli/train_command.py` (docs/running.md).
"""

from efficient_lm.cli import train_command


def run() -> None:
  """The `efficient-lm-train` console script."""
  train_command.run()


if __name__ == "__main__":
  run()
