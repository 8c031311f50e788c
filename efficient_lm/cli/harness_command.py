"""The lm-evaluation-harness adapter: a trained model (`efficient_lm.load`) as an lm-eval `LM`.

    python -m efficient_lm.harness --workdir=runs/pi_attention --tasks=lambada_openai,hellaswag
        [--include_path=DIR] [--limit=N] [--num_fewshot=K] [--batch_size=B] --output=FILE.json

Writes lm-eval's results json (`results.<task>.<metric>,<filter>`, the task configs, versions)
to --output, prints lm-eval's table on stderr and the results as one JSON line on stdout; one
`error: ...` line and exit status 2 for an unknown task, a task whose data cannot be had (offline
and not in the local Hugging Face cache, or the hub out of reach), a folder that is not a model or
a request the model cannot score. In Python, `EfficientLM(path)` (registered as "efficient_lm") can be
given to `lm_eval.simple_evaluate(model=...)` (`efficient_lm.cli.harness_model`).

What each request type does (docs/using_a_model.md):
- `loglikelihood(context, continuation)`: one window of the model's seq_len, [eos] + context +
  continuation cut on the left, the continuation always scored whole (refused when it is longer
  than the positions the model predicts), through the library's score step
  (`scoring.make_score_step`: the train step's loss, no [B, T, V] logits on the host).
- `loglikelihood_rolling(text)`: the stream [eos] + text in `scoring.window_batch`'s windows of
  seq_len inputs (Perceiver-AR: strides of its latents), every token scored once: its perplexity
  is `scoring.score_stream`'s on the same stream and windows.
- `generate_until(context, gen_kwargs)`: `.generate` in batches, greedy unless `do_sample`, cut at
  the `until` strings, `max_gen_toks` new tokens at most (the prompt cut on the left to fit
  seq_len).
"""

import logging
import os
import sys

from absl import flags

from efficient_lm.cli import command
from efficient_lm.cli import common as cli_lib
from efficient_lm.inference.export_format import LoadError
from efficient_lm.runtime import exit_codes
from efficient_lm.runtime import figures
from efficient_lm.runtime import output


def _adapter():
  """`harness_model`, the adapter (lm-eval's `LM` over `efficient_lm.load`)."""
  # Imported here: lm_eval (the `eval` extra) and jax load only after the flags are checked.
  from efficient_lm.cli import harness_model  # pylint: disable=import-outside-toplevel
  return harness_model


def tasks_missing(task_names: list[str], include_path: str | None,
                  include_defaults: bool = True) -> tuple[list[str], object]:
  """(the names lm-eval knows neither as a task, a group nor a tag, its TaskManager); with
  `include_defaults` False only the tasks of `include_path` are indexed (no scan of lm-eval's)."""
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
  known = manager.match_tasks(task_names)
  return [t for t in task_names if t not in known], manager


OFFLINE_FLAGS = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
LOCAL_TASKS = ('give a task over local files with --include_path (docs/using_a_model.md, "Your own '
               'task, offline")')


def build_tasks(tasks: list[str], manager) -> list:
  """Each task built alone, as lm-eval builds it (its data downloaded once into the Hugging Face
  cache, or read from there), before the model loads: a task whose data cannot be had is a
  `HarnessError` naming the task and why (offline, the hub out of reach, not in the local cache).
  Returns what `simple_evaluate` is given: the built tasks and groups (lm-eval's
  `TaskManager.load`), or with an lm-eval without it the names (built again, from the cache)."""
  import datasets  # pylint: disable=import-outside-toplevel
  harness_model = _adapter()
  built = []
  for name in tasks:
    try:
      if hasattr(manager, "load"):
        loaded = manager.load([name])
        group = loaded["groups"].get(name)
        built.extend([group] if group is not None else loaded["tasks"].values())
      else:
        from lm_eval.tasks import get_task_dict  # pylint: disable=import-outside-toplevel
        get_task_dict([name], manager)
        built.append(name)
    except (OSError, datasets.exceptions.DatasetsError) as e:
      raise harness_model.HarnessError(unavailable(name, e)) from e
  return built


def unavailable(task: str, error: BaseException) -> str:
  """The one line for a task whose data `error` kept from being read."""
  import datasets  # pylint: disable=import-outside-toplevel
  detail = " ".join(str(error).split())[:300] or type(error).__name__
  cache = datasets.config.HF_DATASETS_CACHE
  chain, cause = [], error
  while cause is not None and len(chain) < 10:
    chain.append(cause)
    cause = cause.__cause__ or cause.__context__
  names = " ".join(type(c).__name__ for c in chain) + " " + " ".join(map(str, chain))
  offline = [f for f in OFFLINE_FLAGS
             if os.environ.get(f, "").strip().upper() in ("1", "ON", "YES", "TRUE")]
  blocked = "OfflineModeIsEnabled" in names
  if blocked or any(isinstance(c, ConnectionError) for c in chain) or "LocalEntryNotFound" in names:
    if offline or blocked:
      flags_set = "=1, ".join(offline) + "=1" if offline else "offline mode"
      return (f"--tasks: {task} needs data that is not in the local Hugging Face cache ({cache}) "
              f"and cannot be downloaded offline ({flags_set}): {detail}; run it once online to "
              f"cache the data, or {LOCAL_TASKS}")
    return (f"--tasks: {task} needs data that is not in the local Hugging Face cache ({cache}), "
            f"and the Hugging Face Hub cannot be reached to download it: {detail}; run it where "
            f"the hub can be reached once, or {LOCAL_TASKS}")
  return (f"--tasks: {task}'s data cannot be read ({type(error).__name__}: {detail}); check the "
          "task's dataset_path and data_files (a path is relative to the folder the command runs "
          "in)")


def evaluate(model, tasks: list[str], *, include_path: str | None = None, limit=None,
             num_fewshot: int | None = None, batch_size: int = 8, seed: int = 0,
             include_defaults: bool = True) -> dict:
  """lm-eval's `simple_evaluate` of `model` (a folder, or a `harness_model.EfficientLM`) on
  `tasks`: its results dict (json-serialisable with `lm_eval.utils.handle_non_serializable`). An
  unknown task, or one whose data cannot be had (`build_tasks`), is a `HarnessError` before the
  model loads."""
  import lm_eval  # pylint: disable=import-outside-toplevel
  harness_model = _adapter()
  missing, manager = tasks_missing(tasks, include_path, include_defaults)
  if missing:
    if include_defaults:
      where = "lm-eval's own tasks" + (f" or those in --include_path={include_path}"
                                       if include_path else "")
    else:
      where = f"the tasks in --include_path={include_path} (--noinclude_defaults)"
    raise harness_model.HarnessError(
        f"--tasks: {', '.join(missing)} is not among {where}; check the name with `lm_eval ls "
        "tasks`, or give the folder of your task YAML files with --include_path")
  built = build_tasks(tasks, manager)
  lm = model if isinstance(model, harness_model.EfficientLM) else harness_model.EfficientLM(
      str(model), batch_size=batch_size, seed=seed)
  results = lm_eval.simple_evaluate(model=lm, tasks=built, task_manager=manager, limit=limit,
                                    num_fewshot=num_fewshot, log_samples=False,
                                    random_seed=seed, numpy_random_seed=seed,
                                    torch_random_seed=None, fewshot_random_seed=seed)
  if results is None:
    raise harness_model.HarnessError("lm-eval returned no results")
  results["config"]["model"] = harness_model.MODEL_NAME
  results["config"]["model_args"] = f"path={getattr(lm.lm, 'path', '')}"
  return results


def cli(*, workdir: str, tasks: str, output_file: str, include_path: str | None = None,
        limit: float | None = None, num_fewshot: int | None = None, batch_size: int = 8,
        seed: int = 0, include_defaults: bool = True) -> int:
  """What the command does; returns the exit status (2 and one `error: ...` line for input it
  cannot use)."""
  try:
    import lm_eval  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    return cli_lib.error(f"the lm-eval adapter needs the lm_eval package ({e}); install the extra "
                         "with pip install -e '.[eval]'")
  harness_model = _adapter()
  logging.getLogger("lm_eval").setLevel(logging.WARNING)
  import datasets  # pylint: disable=import-outside-toplevel
  datasets.disable_progress_bars()
  names = [t.strip() for t in tasks.split(",") if t.strip()]
  if not names:
    return cli_lib.error("--tasks is empty; give lm-eval task names, e.g. --tasks=hellaswag")
  if include_path and not os.path.isdir(include_path):
    return cli_lib.error(f"--include_path={include_path} is not a folder; give the folder holding "
                         "your task YAML files")
  if limit is not None and limit <= 0:
    return cli_lib.error(f"--limit={limit:g} must be positive (documents per task, or a fraction "
                         "below 1); leave it out to run every document")
  if limit is not None and limit >= 1:
    limit = int(limit)
  try:
    results = evaluate(workdir, names, include_path=include_path, limit=limit,
                       num_fewshot=num_fewshot, batch_size=batch_size, seed=seed,
                       include_defaults=include_defaults)
  except (harness_model.HarnessError, LoadError) as e:
    return cli_lib.error(e)
  from lm_eval.utils import handle_non_serializable, make_table  # pylint: disable=import-outside-toplevel
  text = figures.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
  folder = os.path.dirname(os.path.abspath(output_file))
  os.makedirs(folder, exist_ok=True)
  tmp = f"{output_file}.{os.getpid()}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text + "\n")
  os.replace(tmp, output_file)
  print(make_table(results), file=sys.stderr)
  print(f"results: {output_file}", file=sys.stderr)
  output.result_json(results["results"], default=handle_non_serializable)
  return exit_codes.SUCCESS


def _harness(FLAGS) -> int:  # pylint: disable=invalid-name
  return cli(workdir=FLAGS.workdir, tasks=FLAGS.tasks, output_file=FLAGS.output,
             include_path=FLAGS.include_path, limit=FLAGS.limit, num_fewshot=FLAGS.num_fewshot,
             batch_size=FLAGS.batch_size, seed=FLAGS.seed, include_defaults=FLAGS.include_defaults)


def _define_flags() -> None:
  flags.DEFINE_string("workdir", None, "A training workdir or an export folder (efficient_lm.load).")
  flags.DEFINE_string("tasks", None, "Comma-separated lm-eval task, group or tag names.")
  flags.DEFINE_string("output", None, "Where lm-eval's results json goes (FILE.json).")
  flags.DEFINE_string("include_path", None, "A folder of task YAML files of your own.")
  flags.DEFINE_bool("include_defaults", True, "Also index lm-eval's own tasks (a scan of a few "
                    "thousand YAML files); --noinclude_defaults: only those of --include_path.")
  flags.DEFINE_float("limit", None, "Documents per task (>= 1), or a fraction of them (< 1).")
  flags.DEFINE_integer("num_fewshot", None, "Few-shot examples; default the task's.")
  flags.DEFINE_integer("batch_size", 8, "Windows of seq_len tokens per step, prompts per "
                       "generation call.", lower_bound=1)
  flags.DEFINE_integer("seed", 0, "lm-eval's seeds (python, numpy, few-shot) and the sampling "
                       "seed of do_sample requests.")
  flags.mark_flags_as_required(["workdir", "tasks", "output"])


COMMAND = command.Command(body=_harness,
                          phase=lambda FLAGS: f"evaluating {FLAGS.workdir} with lm-eval",
                          define_flags=_define_flags)


def run() -> None:
  """The command: `python -m efficient_lm.harness` and the `efficient-lm-harness` console script
  (`efficient_lm.harness.run`)."""
  command.run(COMMAND)
