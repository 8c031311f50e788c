"""Evaluates a trained model with the lm-evaluation-harness: `python -m efficient_lm.harness
--workdir=DIR --tasks=NAMES --output=FILE.json`.

The command's flags and body: `efficient_lm/cli/harness_command.py`; the adapter:
`efficient_lm/cli/harness_model.py` (docs/using_a_model.md).
"""

from efficient_lm.cli import harness_command


def run() -> None:
  """The `efficient-lm-harness` console script."""
  harness_command.run()


if __name__ == "__main__":
  run()
