"""`python -m efficient_lm.evaluate --task=ruler`: the grid answered and scored (ruler.json,
ruler.png, one JSON line on stdout), or with `--ruler_out_lm_eval=DIR` the same prompts written as
lm-eval task files instead (docs/long_context_evals.md, "RULER's synthetic tasks")."""

import os

from efficient_lm.evaluation.long_context import ruler_export
from efficient_lm.evaluation.long_context import ruler_grid
from efficient_lm.runtime import exit_codes
from efficient_lm.runtime import output


def run(lm, haystack, *, source: str, tasks, lengths, samples: int, batch_size: int, seed: int,
        out: str | None, lm_eval_out: str | None, log) -> int:
  """Lines on stderr, one JSON line on stdout; the exit status (a `RulerError` for flags that
  cannot run is the caller's to report)."""
  if lm_eval_out:
    ruler_grid.check(tasks, lengths, samples, batch_size)
    cells = ruler_grid.draw(lm.tokenizer, haystack, tasks=tasks, lengths=lengths,
                            samples=samples, seed=seed)
    paths = ruler_export.write(cells, lm_eval_out)
    log(f"wrote {len(paths)} lm-eval tasks ({samples} prompt(s) a task and length, lengths "
        f"{','.join(map(str, lengths))} in {lm.path}'s tokens) to {lm_eval_out}; run them with "
        f"python -m efficient_lm.harness --include_path={lm_eval_out} --noinclude_defaults "
        f"--tasks={ruler_export.GROUP}")
    output.result_json({"task": "ruler", "model": lm.config.model.name, "step": lm.step,
                        "lengths": lengths, "samples": samples, "seed": seed, "haystack": source,
                        "lm_eval_tasks": paths, "include_path": os.path.abspath(lm_eval_out)})
    return exit_codes.SUCCESS
  record = ruler_grid.run(lm, haystack, tasks=tasks, lengths=lengths, samples=samples,
                          batch_size=batch_size, seed=seed, source=source, log=log)
  json_path, png_path = ruler_grid.write(record, out or os.path.join(lm.path, "eval", "ruler"))
  log(ruler_grid.summary(record))
  log(f"wrote {json_path} and {png_path}")
  output.result_json(ruler_grid.result(record, json_path, png_path))
  return exit_codes.SUCCESS
