"""Evaluates a trained workdir (the library: `efficient_lm.evaluation.scoring`).

    python -m efficient_lm.evaluate --workdir=runs/pi_attention [--split=test | --text_file=PATH]
        [--context=N --stride=S] [--per_position] [--ablate_context=N [--ablate_method=swap|eos]]
        [--batch_size=B] [--out=DIR]
    python -m efficient_lm.evaluate --workdir=W --task=needle [--lengths=256,512 --depths=0,0.5,1
        --needles_per_cell=20 --variant=single|multikey|multivalue|multiquery --distractors=9
        --haystack=FILE]
    python -m efficient_lm.evaluate --workdir=W --task=extrapolate [--factors=1,2,4,8]
    python -m efficient_lm.evaluate --workdir=W --task=ruler [--ruler_tasks=niah_single_1,...
        --lengths=256,512 --samples=20 --haystack=FILE --ruler_out_lm_eval=DIR]

Prints progress and a summary line on stderr and the figures as one JSON object, the one line of
stdout, for every --task; one `error: ...` line and exit status 2 for input it cannot use. Ctrl-C
(SIGINT) stops it at once with exit status 130, SIGTERM with 143 (`signals`; nothing is
half-written). Only light modules are imported before the flags are checked.
"""

import sys

from absl import flags

from efficient_lm.cli import command
from efficient_lm.cli import common as cli_lib
from efficient_lm.config.errors import ConfigError
from efficient_lm.evaluation.long_context import ruler_tasks
from efficient_lm.runtime import exit_codes
from efficient_lm.runtime import output
from efficient_lm.runtime import progress
from efficient_lm.state import workdir as workdir_lib


def _summary_line(result: dict) -> str:
  what = result.get("split") or result["text_file"]
  head = f"{result['model']} at step {result['step']} on {what}: loss {result['loss']:.4f} nats/token"
  if "recall" in result:  # MQAR: accuracy by distance
    recall = result["recall"]
    bins = ", ".join(f"[{lo:.0f}, {hi:.0f}): {'-' if a is None else f'{a:.3f}'}"
                     for lo, hi, a in zip(recall["edges"], recall["edges"][1:], recall["accuracy"]))
    return (f"{head} on the answers; recall {recall['accuracy_all']:.3f} of "
            f"{recall['count_all']:,} queries; by distance {bins}")
  latents = "" if result["scored_tokens"] == result["target_tokens"] else (
      f" (the model predicts only its latents: {result['scored_tokens']:,} of "
      f"{result['target_tokens']:,} targets scored, charged that share of the bytes)")
  bits = (f"{result['bits_per_byte']:.4f} bits/byte" if result["bits_per_byte"] is not None else
          f"no bits/byte ({result['bits_per_byte_reason']})")
  line = (f"{head}, perplexity {result['perplexity']:.2f}, {bits} "
          f"over {result['scored_tokens']:,} tokens (context {result['context']}, stride "
          f"{result['stride']}, {result['devices']} device(s)){latents}")
  if "ablation" in result:
    a = result["ablation"]["all"]
    kept = result["ablation"]["kept_context"]
    line += (f"; context beyond {kept[1] + 1} tokens ({result['ablation']['method']} ablation: loss "
             f"{a['full_loss']:.4f} -> {a['ablated_loss']:.4f}) is worth {a['delta']:+.4f} nats/token "
             f"(95% interval [{a['ci_low']:+.4f}, {a['ci_high']:+.4f}] over {a['documents']} "
             f"documents)")
  return line


def cli(*, workdir: str, split: str | None = None, text_file: str | None = None,
        context: int | None = None, stride: int | None = None, batch_size: int | None = None,
        per_position: bool = False, out: str | None = None, ablate_context: int = 0,
        ablate_method: str = "swap", per_query_out: str | None = None, max_tokens: int = 0) -> int:
  """What the command does: a human line on stderr (and how far it is every 20 s:
  `progress.phase`), the figures as the last stdout line (JSON); returns the exit status (2 and one
  `error: ...` line for input it cannot use)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  # Imported here: jax loads only after the flags are checked.
  from efficient_lm import data  # pylint: disable=import-outside-toplevel
  from efficient_lm.evaluation import scoring  # pylint: disable=import-outside-toplevel
  try:
    with progress.phase(f"scoring {workdir} on {text_file or split or 'its eval split'}"):
      result = scoring.evaluate_workdir(workdir, split=split, text_file=text_file,
                                        context=context, stride=stride, batch_size=batch_size,
                                        per_position=per_position, out=out,
                                        ablate_context=ablate_context,
                                        ablate_method=ablate_method,
                                        per_query=bool(per_query_out), max_tokens=max_tokens)
  except (scoring.EvalError, workdir_lib.WorkdirError, ConfigError, data.DataError,
          data.DownloadError) as e:
    return cli_lib.error(e)
  queries = result.pop("queries", None)
  if per_query_out and queries is not None:  # MQAR: every answer, for paired tests across models
    np.savez_compressed(per_query_out, **queries)
  print(_summary_line(result), file=sys.stderr)
  if "out" in result:
    print(f"per-position loss: {result['out']}/per_position.json and per_position.png",
          file=sys.stderr)
  figures = {k: v for k, v in result.items() if not k.startswith("per_position")}
  output.result_json(figures)
  return exit_codes.SUCCESS


def _evaluate(FLAGS) -> int:  # pylint: disable=invalid-name
  if FLAGS.task != "score":  # the long-context evaluations (efficient_lm.evaluation.long_context)
    # Imported here: jax loads only after the flags are checked.
    from efficient_lm.cli import long_context_command  # pylint: disable=import-outside-toplevel
    return long_context_command.run(
        FLAGS.task, workdir=FLAGS.workdir, lengths=FLAGS.lengths, depths=FLAGS.depths,
        needles_per_cell=FLAGS.needles_per_cell, variant=FLAGS.variant,
        distractors=FLAGS.distractors, haystack=FLAGS.haystack, factors=FLAGS.factors,
        split=FLAGS.split, text_file=FLAGS.text_file, batch_size=FLAGS.batch_size,
        out=FLAGS.out, max_tokens=FLAGS.max_tokens, seed=FLAGS.seed, keys=FLAGS.keys,
        ruler_tasks=FLAGS.ruler_tasks, samples=FLAGS.samples,
        ruler_out_lm_eval=FLAGS.ruler_out_lm_eval)
  return cli(workdir=FLAGS.workdir, split=FLAGS.split, text_file=FLAGS.text_file,
             context=FLAGS.context, stride=FLAGS.stride, batch_size=FLAGS.batch_size,
             per_position=FLAGS.per_position, out=FLAGS.out,
             ablate_context=FLAGS.ablate_context, ablate_method=FLAGS.ablate_method,
             per_query_out=FLAGS.per_query_out, max_tokens=FLAGS.max_tokens)


def _define_flags() -> None:
  flags.DEFINE_string("workdir", None, "A training workdir (config.json, tokenizer.model, checkpoints).")
  flags.DEFINE_string("split", None, "A split of the workdir's corpus; default its train.eval_split.")
  flags.DEFINE_string("text_file", None, "A UTF-8 text file to score instead, as one document.")
  flags.DEFINE_integer("context", None, "Inputs per window (at most the model's seq_len); default "
                       "seq_len.")
  flags.DEFINE_integer("stride", None, "Targets each window scores (at most --context); default "
                       "--context. Below it the windows overlap.")
  flags.DEFINE_bool("per_position", False, "Also write per_position.json and per_position.png.")
  flags.DEFINE_integer("ablate_context", 0, "Also score every token with only its last "
                       "ablate_context - stride .. ablate_context - 1 tokens of context, and report "
                       "what the rest is worth (mean difference, bootstrap interval over "
                       "documents); at least --stride, below --context. 0 = off.")
  flags.DEFINE_string("ablate_method", "swap", "What replaces the context beyond --ablate_context: "
                      "'swap' (text of another document of the split: an input the model has seen "
                      "the like of) or 'eos' (end-of-document tokens).")
  flags.DEFINE_integer("max_tokens", 0, "Score only the first documents of the split holding this "
                       "many tokens (bits per byte then estimated); 0 = all of it.")
  flags.DEFINE_string("per_query_out", None, "MQAR workdirs: also write every answer's sequence, "
                      "distance and correctness to this .npz file.")
  flags.DEFINE_integer("batch_size", None, "Windows per step; default data.batch_size, rounded up "
                       "to a multiple of the device count.")
  flags.DEFINE_string("out", None, "Where --per_position writes; default <workdir>/eval/<split or "
                      "file stem>/.")
  flags.DEFINE_enum("task", "score", ["score", "needle", "extrapolate", "ruler"], "score: loss, "
                    "perplexity, bits per byte (above); needle: needle-in-a-haystack grid; "
                    "extrapolate: loss by position at --factors x seq_len; ruler: RULER's 11 "
                    "synthetic tasks (docs/long_context_evals.md).")
  flags.DEFINE_list("lengths", ["256", "512", "768", "1024"], "--task=needle, ruler: prompt "
                    "lengths (tokens), comma-separated.")
  flags.DEFINE_list("depths", ["0", "0.25", "0.5", "0.75", "1"], "--task=needle: needle depths "
                    "(fractions of the haystack, 0 = its start), comma-separated.")
  flags.DEFINE_integer("needles_per_cell", 20, "--task=needle: needles per (length, depth) cell.")
  flags.DEFINE_enum("variant", "single", ["single", "multikey", "multivalue", "multiquery"],
                    "--task=needle: RULER's needle variants.")
  flags.DEFINE_integer("distractors", 9, "--task=needle: random 7-digit answers the true one is "
                       "ranked among.")
  flags.DEFINE_string("haystack", None, "--task=needle, ruler: a UTF-8 text file for the haystacks; "
                      "default the workdir corpus's --split (default test).")
  flags.DEFINE_list("factors", ["1", "2", "4", "8"], "--task=extrapolate: window lengths as "
                    "multiples of the trained seq_len, comma-separated.")
  flags.DEFINE_integer("seed", 0, "--task=needle, ruler: the seed of the needles, keys and "
                       "haystacks.")
  flags.DEFINE_list("ruler_tasks", list(ruler_tasks.TASKS), "--task=ruler: the tasks (lm-eval's "
                    "names), comma-separated.")
  flags.DEFINE_integer("samples", 20, "--task=ruler: prompts per task and length.")
  flags.DEFINE_string("ruler_out_lm_eval", None, "--task=ruler: write the prompts as lm-eval task "
                      "files into this folder (for `efficient_lm.harness --include_path`) instead "
                      "of answering them.")
  flags.DEFINE_enum("keys", "auto", ["auto", "pairs", "words"], "--task=needle: the needles' "
                    "keys: two random words (pairs), the needle: training source's key words "
                    "(words), or auto: words for a workdir trained on needle:, else pairs.")
  flags.mark_flags_as_required(["workdir"])


COMMAND = command.Command(body=_evaluate, phase=lambda FLAGS: f"evaluating {FLAGS.workdir}",
                          define_flags=_define_flags, discard_library_prints=True)


def run() -> None:
  """The command: `python -m efficient_lm.evaluate` and the `efficient-lm-eval` console script
  (`efficient_lm.evaluate.run`)."""
  command.run(COMMAND)
