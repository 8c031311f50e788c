"""Peak resident memory of a resumed run against a fresh run of the same model, side by side.

    python -m experiments.bench_resume                          # d_model 1024 x 8 layers, 3 pairs
    python -m experiments.bench_resume --d_model=128 --num_layers=2 --repeats=1 --out=/tmp/r.json

Each repeat: a fresh run (`python -m efficient_lm.main`, 2 steps, a new workdir) and a resumed
one (a workdir checkpointed at step 1 by a 1-step run, then the same command to step 2), each a
process of its own, each saving one checkpoint (at its end); the peak RSS of each (`ru_maxrss`,
`runner.run_monitored`). A resumed run
that built a random-init state beside the restored one would hold the train state twice. The
data is MQAR (generated, no files: no tokenizer or corpus in the figure). Writes
experiments/results/resume_memory.json: the medians, their ratio, the train state's size.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

from experiments.common import REPO
from experiments.runner import run_monitored, tail

SEQ_LEN = 128
TASK = f"mqar:seq_len={SEQ_LEN},eval_sequences=8"


def command(workdir: str, steps: int, args) -> list[str]:
  settings = {
      "data.dataset": TASK, "data.seq_len": SEQ_LEN, "data.vocab_size": 3075,
      "data.batch_size": 2, "model.d_model": args.d_model, "model.num_layers": args.num_layers,
      "model.num_heads": 8, "train.num_steps": steps, "train.warmup_steps": 1,
      "train.checkpoint_every": 100000, "train.eval_every": 100000, "train.sample_tokens": 0,
      "train.compilation_cache_dir": "", "mesh.fsdp": 1}
  return [sys.executable, "-m", "efficient_lm.main", "--config=configs/dense.py",
          f"--workdir={workdir}", *[f"--config.{k}={v}" for k, v in settings.items()]]


def peak_mib(cmd: list[str], log: str) -> float:
  run = run_monitored(cmd, log)
  if run["returncode"] != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{tail(log)}")
  return run["peak_rss_mib"]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--d_model", type=int, default=1024)
  parser.add_argument("--num_layers", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default=os.path.join(REPO, "experiments", "results",
                                                    "resume_memory.json"))
  args = parser.parse_args(argv)
  fresh, resumed = [], []
  with tempfile.TemporaryDirectory() as tmp:
    for i in range(args.repeats):
      a, b = os.path.join(tmp, f"fresh{i}"), os.path.join(tmp, f"resumed{i}")
      fresh.append(peak_mib(command(a, 2, args), a + ".log"))
      peak_mib(command(b, 1, args), b + ".first.log")  # checkpointed at step 1
      resumed.append(peak_mib(command(b, 2, args), b + ".log"))
      with open(b + ".log") as f:
        assert "resumed from" in f.read(), f"{b}: the second run did not resume:\n{tail(b + '.log')}"
      print(f"repeat {i}: fresh {fresh[-1]:.0f} MiB, resumed {resumed[-1]:.0f} MiB", flush=True)
  # Parameters and Adam's two moments, float32: 12 d^2 per layer (attention 4 d^2, MLP 8 d^2)
  # plus the tied embedding.
  params = args.num_layers * 12 * args.d_model**2 + 3075 * args.d_model
  result = {"command": " ".join(["python -m experiments.bench_resume", *(argv or sys.argv[1:])]),
            "d_model": args.d_model, "num_layers": args.num_layers, "seq_len": SEQ_LEN,
            "train_state_mib": 3 * 4 * params / 2**20, "fresh_peak_rss_mib": fresh,
            "resumed_peak_rss_mib": resumed, "fresh_median_mib": statistics.median(fresh),
            "resumed_median_mib": statistics.median(resumed),
            "ratio": statistics.median(resumed) / statistics.median(fresh)}
  print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=1))
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
