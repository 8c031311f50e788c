"""Samples text from a trained workdir (the library: `efficient_lm.inference.generation`).

    python -m efficient_lm.sample --workdir=runs/pi_attention --prompt="ROMEO:\\n" --max_new_tokens=200
    python -m efficient_lm.sample --workdir=runs/pi_attention --prompt=A --prompt=B --temperature=0 --json
    python -m efficient_lm.sample --workdir=runs/pi_attention --prompts_file=prompts.txt --stop="\\n\\n"

Loads the workdir's config, tokenizer and latest checkpoint, continues every prompt (`--prompt`,
repeatable, then each line of `--prompts_file`) in one batched call, and prints on stdout each
prompt and its continuation, or with `--json` one JSON object a prompt (prompt, text, tokens,
seconds), nothing else; one `error: ...` line and exit status 2 for input it cannot use. A
continuation ends at the end-of-document token, after `--max_new_tokens`, or before a `--stop`
string. Ctrl-C (SIGINT) stops it at once with exit status 130, SIGTERM with 143 (`signals`). Only
light modules are imported before the flags are checked.
"""

import re
import sys

from absl import flags

from efficient_lm.cli import command
from efficient_lm.cli import common as cli
from efficient_lm.runtime import output
from efficient_lm.state import workdir as workdir_lib

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str) -> str:
  r"""`\n`, `\t` and `\\` in a command-line prompt as a newline, a tab and a backslash; every other
  character (any Unicode text included) as it is."""
  return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def _prompts(FLAGS) -> list[str]:  # pylint: disable=invalid-name
  """--prompt (each), then each non-blank line of --prompts_file; [""] when neither is given."""
  prompts = list(FLAGS.prompt or [])
  if FLAGS.prompts_file:
    try:
      with open(FLAGS.prompts_file, encoding="utf-8") as f:
        prompts += [line.rstrip("\r\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
      raise ValueError(f"--prompts_file={FLAGS.prompts_file} cannot be read ({e}): give a UTF-8 text "
                       "file with one prompt a line") from e
    if len(prompts) == len(FLAGS.prompt or []):
      raise ValueError(f"--prompts_file={FLAGS.prompts_file} holds no prompt: write one a line")
  prompts = prompts or [""]
  return [unescape(p) for p in prompts] if FLAGS.escapes else prompts


def _sample(FLAGS) -> int | None:  # pylint: disable=invalid-name
  # Imported here: jax loads only after the flags are checked.
  from efficient_lm.inference import generation, restore  # pylint: disable=import-outside-toplevel
  try:
    generation.check_sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    if FLAGS.max_new_tokens < 1:
      raise ValueError(f"--max_new_tokens={FLAGS.max_new_tokens} must be at least 1")
    prompts = _prompts(FLAGS)
    stop = [unescape(s) if FLAGS.escapes else s for s in FLAGS.stop or []]
    if any(not s for s in stop):
      raise ValueError("--stop= is empty: give the text that ends a continuation (or no --stop)")
    restored = restore.restore(FLAGS.workdir, sharded=True, exports=False)  # sharded, as trained
  except (ValueError, workdir_lib.WorkdirError) as e:
    return cli.error(e)
  model, tokenizer, config = restored.model, restored.tokenizer, restored.config
  print(f"{config.model.name} at step {restored.step} from {FLAGS.workdir}", file=sys.stderr)
  # Imported here: jax loads only after the flags are checked.
  from efficient_lm.ops import report  # pylint: disable=import-outside-toplevel
  print("\n".join(report.prompts_lines(model, [tokenizer.encode(p) for p in prompts],
                                       num_tokens=FLAGS.max_new_tokens,
                                       prefill_chunk=FLAGS.prefill_chunk or None)), file=sys.stderr)
  try:
    results = generation.generate_texts(model, tokenizer, prompts, num_tokens=FLAGS.max_new_tokens,
                                        seed=FLAGS.seed, temperature=FLAGS.temperature,
                                        top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                                        prefill_chunk=FLAGS.prefill_chunk or None,
                                        document_mask=config.data.document_mask, stop=stop)
  except ValueError as e:
    return cli.error(e)
  for r in results:
    if FLAGS.json:
      output.result_json({"prompt": r.prompt, "text": r.text, "tokens": r.tokens,
                          "seconds": round(r.seconds, 3)}, ensure_ascii=False)
    else:
      output.result(r.text)


def _define_flags() -> None:
  flags.DEFINE_string("workdir", None, "A training workdir (config.json, tokenizer.model, checkpoints).")
  flags.DEFINE_multi_string("prompt", None, "A text to continue; repeat the flag for more, all "
                            "decoded in one batch (none and no --prompts_file: the empty prompt).")
  flags.DEFINE_string("prompts_file", None, "A UTF-8 file of prompts, one a line (blank lines "
                      "skipped), after the --prompt ones.")
  flags.DEFINE_bool("escapes", True, r"Read \n, \t and \\ in --prompt, --prompts_file lines and "
                    "--stop as a newline, a tab and a backslash.")
  flags.DEFINE_integer("max_new_tokens", 200, "How many tokens to generate.")
  flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 = greedy.")
  flags.DEFINE_multi_string("stop", None, "A continuation ends before this text (repeatable); it "
                            "also ends at the end-of-document token.")
  flags.DEFINE_bool("json", False, "One JSON object a prompt on stdout: prompt, text (the prompt "
                    "and its continuation), tokens (the new ids), seconds (the whole call's, or until "
                    "the check that found its --stop string).")
  flags.DEFINE_integer("top_k", 40, "Sample from the k most likely tokens; 0 = all.")
  flags.DEFINE_float("top_p", 1.0, "Sample from the smallest set with this much probability; 1 = all.")
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_integer("prefill_chunk", 0, "Prefill long prompts in chunks of this many tokens "
                       "(bounds memory); 0 = one parallel pass.")
  flags.mark_flags_as_required(["workdir"])


COMMAND = command.Command(body=_sample, phase=lambda FLAGS: f"sampling from {FLAGS.workdir}",
                          define_flags=_define_flags)


def run() -> None:
  """The command: `python -m efficient_lm.sample` and the `efficient-lm-sample` console script
  (`efficient_lm.sample.run`)."""
  command.run(COMMAND)
