"""Exports a trained workdir's weights as safetensors (the library: `efficient_lm.load` reads them).

    python -m efficient_lm.export --workdir=runs/pi_attention --out=exports/pi_attention
        [--step=N] [--dtype=bfloat16] [--max_shard_bytes=5000000000] [--overwrite]

What it writes, and why it never replaces what it did not write: the format's writer,
`efficient_lm/inference/export.py`. One `error: ...` line and exit status 2 for input it cannot
use (no checkpoint, an export given as `--workdir`, an `--out` it may not write).
Only light modules are imported before the flags are checked.
"""

import sys

from absl import flags

from efficient_lm.cli import command
from efficient_lm.cli import common as cli_lib
from efficient_lm.inference import export as export_lib
from efficient_lm.runtime import exit_codes
from efficient_lm.runtime import output
from efficient_lm.state import workdir as workdir_lib


def cli(*, workdir: str, out: str, step: int | None = None, dtype: str | None = None,
        max_shard_bytes: int = export_lib.DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False) -> int:
  """What the command does: one line on stderr, the summary as the last stdout line (JSON);
  returns the exit status (2 and one `error: ...` line for input it cannot use)."""
  invoked = "python -m efficient_lm.export " + " ".join(sys.argv[1:])
  try:  # the refusals that need no jax first
    export_lib.check_args(dtype=dtype, max_shard_bytes=max_shard_bytes, step=step)
    export_lib.check_out(out, overwrite)
    export_lib.check_workdir(workdir)
  except (export_lib.ExportError, workdir_lib.WorkdirError) as e:
    return cli_lib.error(e)
  # Imported here: Orbax loads only after the refusals that need none.
  from efficient_lm.state import checkpoint  # pylint: disable=import-outside-toplevel
  try:
    result = export_lib.export(workdir, out, step=step, dtype=dtype,
                               max_shard_bytes=max_shard_bytes, overwrite=overwrite,
                               command=invoked)
  except (export_lib.ExportError, workdir_lib.WorkdirError,
          checkpoint.NoRestorableCheckpointError) as e:
    return cli_lib.error(e)
  print(f"exported step {result['step']} of {workdir} to {result['out']}: "
        f"{result['num_params']:,} parameters ({result['dtype']}, {result['total_size']:,} bytes) "
        f"in {', '.join(result['files'])}", file=sys.stderr)
  output.result_json(result)
  return exit_codes.SUCCESS


def _export(FLAGS) -> int:  # pylint: disable=invalid-name
  return cli(workdir=FLAGS.workdir, out=FLAGS.out, step=FLAGS.step, dtype=FLAGS.dtype,
             max_shard_bytes=FLAGS.max_shard_bytes, overwrite=FLAGS.overwrite)


def _define_flags() -> None:
  flags.DEFINE_string("workdir", None, "A training workdir (config.json, tokenizer, checkpoints).")
  flags.DEFINE_string("out", None, "The folder to write (created; new or empty, or a previous "
                      "export with --overwrite; never a workdir).")
  flags.DEFINE_integer("step", None, "The checkpoint to export; default the latest.")
  flags.DEFINE_string("dtype", None, "Store floating tensors as this "
                      f"({', '.join(export_lib.DTYPES)}); default the dtype trained.")
  flags.DEFINE_integer("max_shard_bytes", export_lib.DEFAULT_MAX_SHARD_BYTES, "Bytes per "
                       "safetensors file; past it the weights are sharded "
                       "(model-00001-of-0000K.safetensors and model.safetensors.index.json).")
  flags.DEFINE_bool("overwrite", False, "Replace the previous export at --out (a folder holding "
                    "anything else is refused).")
  flags.mark_flags_as_required(["workdir", "out"])


COMMAND = command.Command(body=_export, phase=lambda FLAGS: f"exporting {FLAGS.workdir}",
                          define_flags=_define_flags)


def run() -> None:
  """The command: `python -m efficient_lm.export` and the `efficient-lm-export` console script
  (`efficient_lm.export.run`)."""
  command.run(COMMAND)
