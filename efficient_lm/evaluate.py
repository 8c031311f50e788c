"""Evaluates a trained workdir: `python -m efficient_lm.evaluate --workdir=DIR [--task=...]`.

The command's flags and body: `efficient_lm/cli/evaluate_command.py` (docs/evaluation.md,
docs/long_context_evals.md).
"""

from efficient_lm.cli import evaluate_command


def run() -> None:
  """The `efficient-lm-eval` console script."""
  evaluate_command.run()


if __name__ == "__main__":
  run()
