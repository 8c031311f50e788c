"""Samples text from a trained workdir (the library: `efficient_lm.generation`).

    python -m efficient_lm.sample --workdir=runs/pi_attention --prompt="ROMEO:\\n" --max_new_tokens=200

Loads the workdir's config, tokenizer and latest checkpoint and prints the prompt and its
continuation on stdout, nothing else; one `error: ...` line and exit status 2 for input it cannot
use. Ctrl-C (SIGINT) stops it at once with exit status 130, SIGTERM with 143 (`signals`). Only
light modules are imported before the flags are checked.
"""

import re
import sys

from absl import flags
from absl import logging as absl_logging

from efficient_lm import cli
from efficient_lm import exit_codes
from efficient_lm import output
from efficient_lm import signals

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str) -> str:
  r"""`\n`, `\t` and `\\` in a command-line prompt as a newline, a tab and a backslash; every other
  character (any Unicode text included) as it is."""
  return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def main(argv) -> None:
  del argv
  FLAGS = flags.FLAGS
  output.reserve_stdout()
  absl_logging.set_verbosity(absl_logging.WARNING)  # the libraries' (Orbax) warnings only
  with signals.phase(f"sampling from {FLAGS.workdir}"):
    _sample(FLAGS)


def _sample(FLAGS) -> None:  # pylint: disable=invalid-name
  from efficient_lm import generation, scoring  # pylint: disable=import-outside-toplevel
  from efficient_lm import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  try:
    generation.check_sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    if FLAGS.max_new_tokens < 1:
      raise ValueError(f"--max_new_tokens={FLAGS.max_new_tokens} must be at least 1")
    saved = workdir_lib.Workdir(FLAGS.workdir).saved_config()
    mesh = scoring.eval_mesh(saved) if saved is not None else None  # restored sharded, as trained
    model, tokenizer, config, step = generation.load_workdir(FLAGS.workdir, mesh=mesh)
  except (ValueError, workdir_lib.WorkdirError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(exit_codes.USAGE)
  print(f"{config.model.name} at step {step} from {FLAGS.workdir}", file=sys.stderr)
  prompt = unescape(FLAGS.prompt) if FLAGS.escapes else FLAGS.prompt
  try:
    text = generation.generate_text(model, tokenizer, prompt, num_tokens=FLAGS.max_new_tokens,
                                    seed=FLAGS.seed, temperature=FLAGS.temperature,
                                    top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                                    prefill_chunk=FLAGS.prefill_chunk or None,
                                    document_mask=config.data.document_mask)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(exit_codes.USAGE)
  output.result(text)


def _define_flags() -> None:
  flags.DEFINE_string("workdir", None, "A training workdir (config.json, tokenizer.model, checkpoints).")
  flags.DEFINE_string("prompt", "", "The text to continue.")
  flags.DEFINE_bool("escapes", True, r"Read \n and \t in --prompt as a newline and a tab.")
  flags.DEFINE_integer("max_new_tokens", 200, "How many tokens to generate.")
  flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 = greedy.")
  flags.DEFINE_integer("top_k", 40, "Sample from the k most likely tokens; 0 = all.")
  flags.DEFINE_float("top_p", 1.0, "Sample from the smallest set with this much probability; 1 = all.")
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_integer("prefill_chunk", 0, "Prefill long prompts in chunks of this many tokens "
                       "(bounds memory); 0 = one parallel pass.")
  flags.mark_flags_as_required(["workdir"])


def run() -> None:
  """The `efficient-lm-sample` console script."""
  signals.install(training=False)
  _define_flags()
  signals.run_command(main, cli.parse_flags)


if __name__ == "__main__":
  run()
