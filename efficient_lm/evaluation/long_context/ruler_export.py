"""RULER's prompts as lm-eval task files (`--task=ruler --ruler_out_lm_eval=DIR`), so that the
same items run on any model through `python -m efficient_lm.harness --include_path=DIR`.

DIR gets, for each task, `<task>.jsonl` (a document a prompt: `input`, the prompt with its answer
prefix; `outputs`, the expected strings; `length`, its target; `lengths`, every length of the
export) and `<task>.yaml` (lm-eval's name for the task, `generate_until`, greedy, RULER's new
tokens, no stop string; a metric a length, scored by `ruler_score.process_results` through
`utils.py`), and the group `ruler_offline.yaml` of them all. The jsonl paths in the YAML files are
absolute: move the folder, write it again.
"""

import json
import os

from efficient_lm.evaluation.long_context import ruler

GROUP = "ruler_offline"
_UTILS = '''"""RULER's score for the tasks `python -m efficient_lm.evaluate --task=ruler --ruler_out_lm_eval`
wrote here: the share of the expected strings in the answer (efficient_lm.evaluation.long_context.ruler_score)."""
from efficient_lm.evaluation.long_context.ruler_score import aggregate, process_results  # noqa: F401
'''


def _yaml(task: str, data: str, lengths) -> str:
  metrics = "".join(f'  - metric: "{n}"\n    aggregation: !function utils.aggregate\n'
                    "    higher_is_better: true\n" for n in lengths)
  return (f"task: {task}\n"
          "dataset_path: json\n"
          f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(data)}\n"
          "test_split: test\n"
          "output_type: generate_until\n"
          'doc_to_text: "{{input}}"\n'
          'doc_to_target: "{{outputs}}"\n'
          "process_results: !function utils.process_results\n"
          f"generation_kwargs:\n  until: []\n  max_gen_toks: {ruler.SPECS[task].new_tokens}\n"
          "  do_sample: false\n  temperature: 0.0\n"
          f"metric_list:\n{metrics}"
          "metadata:\n  version: 1.0\n")


def write(cells: dict, out: str) -> dict:
  """The task files of `cells` ({(task, length): [Item, ...]}, as `ruler_grid.draw` returns them)
  into `out`; returns {task: its jsonl path}."""
  out = os.path.abspath(out)
  os.makedirs(out, exist_ok=True)
  tasks = [t for t in ruler.TASKS if any(key[0] == t for key in cells)]
  lengths = sorted({key[1] for key in cells})
  paths = {}
  for task in tasks:
    data = os.path.join(out, f"{task}.jsonl")
    with open(data, "w", encoding="utf-8") as f:
      for length in lengths:
        for item in cells.get((task, length), ()):
          f.write(json.dumps({"index": item.index, "input": item.text, "outputs": item.outputs,
                              "length": length, "lengths": lengths,
                              "tokens": len(item.ids) + 1}, ensure_ascii=False) + "\n")
    with open(os.path.join(out, f"{task}.yaml"), "w", encoding="utf-8") as f:
      f.write(_yaml(task, data, lengths))
    paths[task] = data
  with open(os.path.join(out, "utils.py"), "w", encoding="utf-8") as f:
    f.write(_UTILS)
  with open(os.path.join(out, f"{GROUP}.yaml"), "w", encoding="utf-8") as f:
    f.write(f"group: {GROUP}\ntask:\n" + "".join(f"  - {t}\n" for t in tasks) +
            "metadata:\n  version: 1.0\n")
  return paths
