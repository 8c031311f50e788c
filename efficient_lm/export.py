"""Exports a trained workdir's weights as safetensors: `python -m efficient_lm.export --workdir=DIR
--out=DIR`.

The command's flags and body: `efficient_lm/cli/export_command.py`; the format's writer:
`efficient_lm/inference/export.py` (docs/using_a_model.md).
"""

from efficient_lm.cli import export_command


def run() -> None:
  """The `efficient-lm-export` console script."""
  export_command.run()


if __name__ == "__main__":
  run()
