"""`python -m efficient_lm.evaluate --task=needle | extrapolate | ruler`: the flags read, the model and
its held-out text loaded, the figures written (docs/long_context_evals.md)."""

import os
import sys

from efficient_lm import data
from efficient_lm.cli import ruler_command
from efficient_lm.config.errors import ConfigError
from efficient_lm.data import needle as needle_source
from efficient_lm.data import hooks
from efficient_lm.data import registry
from efficient_lm.evaluation import scoring
from efficient_lm.evaluation.long_context import extrapolate, needle, needle_grid, reach, ruler_fit
from efficient_lm.inference import restore as restore_lib
from efficient_lm.runtime import exit_codes
from efficient_lm.runtime import output
from efficient_lm.runtime import progress
from efficient_lm.state import checkpoint
from efficient_lm.state import workdir as workdir_lib

TASKS = ("score", "needle", "extrapolate", "ruler")


class UsageError(ValueError):
  """A flag value that cannot be used; the message names the flag and the fix."""


def parse_list(name: str, values, kind):
  """`--name=a,b,c` (absl's list flag) as numbers of `kind`."""
  try:
    return [kind(v) for v in values]
  except (TypeError, ValueError):
    raise UsageError(f"--{name}={','.join(map(str, values))} must be comma-separated "
                     f"{'integers' if kind is int else 'numbers'}") from None


def _stderr(line: str) -> None:
  print(line, file=sys.stderr)


def _held_out(lm, split: str | None, text_file: str | None, flag: str):
  """(token stream, what it is) of a split of the workdir's corpus (default test) or a file."""
  if text_file is not None:
    tokens, _ = scoring.read_text_file(text_file, lm.tokenizer)
    return tokens, os.path.basename(text_file)
  source = registry.source(lm.config.data.dataset)
  if not source.has_text:
    raise UsageError(f"{lm.path} is an MQAR workdir (synthetic tokens, no text); give {flag}=FILE "
                     "of text, or evaluate a text-trained workdir")
  # typed here: the run's config.json; tokenized by the run's tokenizer, whatever the cache holds
  corpus = data.load(data.validate(lm.config.data), tokenizer_file=lm.tokenizer.model_path)
  split = split or "test"
  if split not in corpus.splits:
    raise UsageError(f"--split={split} is not a split of {corpus.name}; use one of "
                     f"{', '.join(s for s in corpus.splits if s != 'train')}")
  if split == "train":
    raise UsageError("--split=train is the training text; use a held-out split (test or "
                     "validation)")
  if flag == "--haystack" and source.planted:
    # A needle workdir's own sequences hold needles: the haystack is its base corpus's text.
    return corpus.base.tokens(split), f"{split} split of {corpus.task.base}"
  return corpus.tokens(split), f"{split} split"


KEYS = ("auto", "pairs", "words")


def key_words(lm, keys: str):
  """The needle keys `--keys` asks for: None (two random words) or a word list. 'auto': the
  training source's key words for a workdir trained on `needle:` (the keys it learned), else
  two random words."""
  if keys not in KEYS:
    raise UsageError(f"--keys={keys} is not one of {', '.join(KEYS)}")
  dataset = lm.config.data.dataset
  planted = registry.source(dataset).planted
  if keys == "pairs" or (keys == "auto" and not planted):
    return None
  if planted:
    return hooks.parse(dataset).key_words
  return needle_source.KEY_WORDS


def run(task: str, *, workdir: str, lengths=(), depths=(), needles_per_cell: int = 20,
        variant: str = "single", distractors: int = 9, haystack: str | None = None,
        factors=(), split: str | None = None, text_file: str | None = None,
        batch_size: int | None = None, out: str | None = None, max_tokens: int = 0,
        seed: int = 0, keys: str = "auto", ruler_tasks=(), samples: int = 20,
        ruler_out_lm_eval: str | None = None) -> int:
  """What the command does for `task`: progress and the summary line on stderr, the figures as one
  JSON line on stdout (each grid's `result`); returns the exit status (2 and
  one `error: ...` line for input it cannot use)."""
  try:
    if task in ("needle", "ruler"):
      lengths = parse_list("lengths", lengths, int)
      depths = parse_list("depths", depths, float) if task == "needle" else depths
      if text_file is not None:
        raise UsageError(f"--text_file is for --task=score and extrapolate; give the {task} "
                         "task's haystack as --haystack=FILE")
    else:
      factors = parse_list("factors", factors, int)
      if haystack is not None:
        raise UsageError("--haystack is for --task=needle and ruler; give extrapolate's text as "
                         "--text_file=FILE or --split")
    if batch_size is not None and batch_size < 1:
      raise UsageError(f"--batch_size={batch_size} must be at least 1")
    lm = restore_lib.restore(workdir)
    batch_size = batch_size or lm.config.data.batch_size
    if task == "needle":
      tokens, source = _held_out(lm, split, haystack, "--haystack")
      record = needle_grid.run(lm, needle.haystack_stream(tokens, lm.eos_id), lengths=lengths,
                               depths=depths, needles_per_cell=needles_per_cell, variant=variant,
                               distractors=distractors, batch_size=batch_size, seed=seed,
                               source=source, key_words=key_words(lm, keys), log=_stderr)
      out = out or os.path.join(lm.path, "eval", f"needle_{variant}")
      json_path, png_path = needle_grid.write(record, out)
      line = needle_grid.summary(record, json_path)
    elif task == "ruler":
      tokens, source = _held_out(lm, split, haystack, "--haystack")
      with progress.phase(f"ruler: {len(ruler_tasks)} task(s) x {len(lengths)} length(s)"):
        return ruler_command.run(lm, needle.haystack_stream(tokens, lm.eos_id), source=source,
                                 tasks=list(ruler_tasks), lengths=lengths, samples=samples,
                                 batch_size=batch_size, seed=seed, out=out,
                                 lm_eval_out=ruler_out_lm_eval, log=_stderr)
    else:
      tokens, source = _held_out(lm, split, text_file, "--text_file")
      record = extrapolate.run(lm, tokens, factors=factors, batch_size=batch_size, source=source,
                               max_tokens=max_tokens, log=_stderr)
      out = out or os.path.join(lm.path, "eval", f"extrapolate_{source.split()[0]}")
      json_path, png_path = extrapolate.write(record, out)
      line = extrapolate.summary(record, json_path)
  except (UsageError, restore_lib.LoadError, workdir_lib.WorkdirError,
          checkpoint.NoRestorableCheckpointError, needle.NeedleError, extrapolate.ExtrapolateError,
          reach.LengthError, ruler_fit.RulerError, scoring.EvalError, ConfigError,
          data.DataError, data.DownloadError) as e:
    print(f"error: {e}", file=sys.stderr)
    return exit_codes.USAGE
  _stderr(line)
  _stderr(f"wrote {json_path} and {png_path}")
  figures = (needle_grid if task == "needle" else extrapolate).result(record, json_path, png_path)
  output.result_json(figures)
  return exit_codes.SUCCESS

