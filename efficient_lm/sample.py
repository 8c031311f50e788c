"""Samples text from a trained workdir: `python -m efficient_lm.sample --workdir=DIR --prompt=TEXT`.

The command's flags and body: `efficient_lm/cli/sample_command.py` (docs/running.md).
"""

from efficient_lm.cli import sample_command


def run() -> None:
  """The `efficient-lm-sample` console script."""
  sample_command.run()


if __name__ == "__main__":
  run()
