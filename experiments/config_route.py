"""Follows the config from `main` into training: which modules it visits, and where it climbs back.

    python -m experiments.config_route [--out=experiments/results/config_route.json] \
        [--config=configs/pi_attention.py] [--steps=2] [-- --config.<field>=<value> ...]

Runs `python -m efficient_lm.main` in this process on a tiny model (2 steps of
configs/pi_attention.py at d_model 32, one layer, 64 tokens, on the default dataset) under
`sys.setprofile` and records every call, within `efficient_lm`, of a function that receives a
config object as an argument: the ConfigDict, any of its sections (a ConfigDict too), the
`RunConfig` the command builds from it (`config.run.build`), or a typed section
(`typed_config.Section`: `ModelConfig`, `DataConfig`, ...). A config class's own methods called on
itself (`cfg.patterns()`, `cfg.context_block`, `run.with_vocab(n)`) are the object answering, not
a visit: the `self` of a method of a `Section` or the `RunConfig` is not counted, nor is any call while a section checks
itself (its fields' `Check`s and its `Rule`s, under `Section.__post_init__`).

A *visit* is entering such a function in a module other than the previous visit's; a *climb* is
a visit to a module of an earlier layer than the module it came from, in the one-way flow

    config (0) -> data (1) -> model (2) -> train (3) -> checkpoint / metrics (4)

`LAYERS` states the table (a module's layer is that of its longest listed prefix). The issue's
goal: at most 10 climbs and no module visited more than 5 times. Prints the visits per module
and the climbs (from -> to, with the functions) and writes them as JSON.
"""

import argparse
import collections
import json
import os
import sys
import tempfile
import threading
from typing import Any, Iterable

PACKAGE = "efficient_lm"
LAYER_NAMES = ("config", "data", "model", "train", "checkpoint/metrics")
# Module (or package) -> layer. The edge and what it reads (the typed sections, their checks,
# the mesh and its rules) are the config layer; the training loop is train; what a run writes
# (checkpoints, metrics, W&B, the sample, the workdir's records) is the last layer.
LAYERS = {
    "efficient_lm": 0,  # anything not listed below: main, cli/, config/, ...
    "efficient_lm.parallel.sharding": 0, "efficient_lm.config.axes": 0,
    "efficient_lm.parallel.targets": 0, "efficient_lm.runtime.jax_devices": 0,
    "efficient_lm.parallel.distributed": 0,
    "efficient_lm.data": 1,
    # The families' modules hold what moved out of models/ to stay jax-free (the model sections'
    # classes, the layers' patterns the mixers are built from): the model's layer, as before.
    "efficient_lm.models": 2, "efficient_lm.families": 2, "efficient_lm.ops": 2,
    "efficient_lm.training.flops": 2,
    "efficient_lm.training.step_memory": 2,
    "efficient_lm.training.loop": 3, "efficient_lm.training.step": 3,
    "efficient_lm.training.start": 3, "efficient_lm.training.evaluate": 3,
    "efficient_lm.training.report": 3, "efficient_lm.training.profile": 3,
    "efficient_lm.training.compile_only": 3,
    "efficient_lm.state.train_state": 3, "efficient_lm.state.optimizer": 3,
    "efficient_lm.harness": 3, "efficient_lm.cli.harness_command": 3,
    "efficient_lm.cli.harness_model": 3, "efficient_lm.runtime.progress": 3,
    "efficient_lm.runtime.signals": 3, "efficient_lm.evaluation.stats": 3,
    "efficient_lm.state.checkpoint": 4, "efficient_lm.training.metrics": 4,
    "efficient_lm.training.wandb": 4, "efficient_lm.state.workdir": 4,
    "efficient_lm.runtime.output": 4, "efficient_lm.sample": 4, "efficient_lm.cli.sample_command": 4,
    "efficient_lm.inference.generation": 4, "efficient_lm.evaluate": 4,
    "efficient_lm.cli.evaluate_command": 4, "efficient_lm.evaluation.scoring": 4,
    "efficient_lm.export": 4, "efficient_lm.cli.export_command": 4,
    "efficient_lm.inference.export": 4, "efficient_lm.runtime.files": 4,
}
GOAL_CLIMBS, GOAL_VISITS = 10, 5


def layer_of(module: str, layers: dict[str, int] = LAYERS) -> int:
  """The layer of `module`: that of its longest prefix in `layers` (a module or a package)."""
  parts = module.split(".")
  for end in range(len(parts), 0, -1):
    prefix = ".".join(parts[:end])
    if prefix in layers:
      return layers[prefix]
  raise KeyError(f"{module} has no layer: add it (or its package) to LAYERS")


def count(trace: Iterable[tuple[str, str]], layers: dict[str, int] = LAYERS) -> dict[str, Any]:
  """Visits and climbs of a trace of (module, function) calls that received a config, in order."""
  visits, climbs, previous = collections.Counter(), [], None
  most = lambda: max(visits.values(), default=0)  # noqa: E731
  for module, function in trace:
    if previous is not None and previous[0] == module:
      previous = (module, function)
      continue
    visits[module] += 1
    if previous is not None and layer_of(module, layers) < layer_of(previous[0], layers):
      climbs.append({"from": previous[0], "from_function": previous[1], "to": module,
                     "to_function": function})
    previous = (module, function)
  return {"visits": dict(visits.most_common()), "climbs": climbs, "num_climbs": len(climbs),
          "most_visits": most(), "meets_goal": len(climbs) <= GOAL_CLIMBS and most() <= GOAL_VISITS}


class Recorder:
  """A `sys.setprofile` function: (module, function) for each call, within the package, of a
  function with a config among its arguments."""

  def __init__(self):
    import ml_collections  # pylint: disable=import-outside-toplevel
    from efficient_lm.config import fields as typed_config  # pylint: disable=import-outside-toplevel
    from efficient_lm.config import run as config_run  # pylint: disable=import-outside-toplevel
    self.kinds = (ml_collections.ConfigDict, typed_config.Section, config_run.RunConfig)
    self.section = typed_config.Section
    self.own = (typed_config.Section, config_run.RunConfig)  # a `self` that answers for itself
    self.root = os.path.dirname(os.path.abspath(sys.modules[PACKAGE].__file__)) + os.sep
    self.trace: list[tuple[str, str]] = []
    self.lock = threading.Lock()
    self.checking = threading.local()  # the `Section.__post_init__` frames being run

  def _has_config(self, frame) -> bool:
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    n += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs
    local = frame.f_locals
    for i, name in enumerate(code.co_varnames[:n]):
      value = local.get(name)
      if i == 0 and name in ("self", "cls") and (
          isinstance(value, self.own) or isinstance(value, type)):
        continue  # a config class's own method on itself (or any classmethod)
      values = (value.values() if isinstance(value, dict) and name != "self"
                else value if isinstance(value, tuple) else (value,))
      if any(isinstance(v, self.kinds) for v in values):
        return True
    return False

  def __call__(self, frame, event, arg):
    del arg
    if event not in ("call", "return") or not frame.f_code.co_filename.startswith(self.root):
      return
    checking = self.checking.__dict__.setdefault("frames", [])
    if frame.f_code is self.section.__post_init__.__code__:
      if event == "call":
        checking.append(frame)
      elif checking and checking[-1] is frame:
        checking.pop()
      return
    if event != "call" or checking:
      return
    module = frame.f_globals.get("__name__", "")
    if module.startswith(PACKAGE) and self._has_config(frame):
      with self.lock:
        self.trace.append((module, frame.f_code.co_qualname))


TINY = ("--config.model.d_model=32", "--config.model.num_layers=1", "--config.model.num_heads=2",
        "--config.model.mlp_ratio=2", "--config.model.window=8", "--config.model.period=8",
        "--config.model.num_skips=2", "--config.model.gate_hidden=8",
        "--config.data.seq_len=64", "--config.data.batch_size=2", "--config.mesh.fsdp=1",
        "--config.train.warmup_steps=1", "--config.train.log_every=1",
        "--config.train.sample_tokens=0")


def route(config: str, steps: int, overrides: list[str], workdir: str) -> list[tuple[str, str]]:
  """The trace of one run of `efficient_lm.main` (in this process) under a Recorder."""
  argv = ["efficient_lm.main", f"--config={config}", f"--workdir={workdir}", *TINY,
          f"--config.train.num_steps={steps}", f"--config.train.eval_every={steps}",
          f"--config.train.checkpoint_every={steps}", *overrides]
  from efficient_lm import main as main_lib  # pylint: disable=import-outside-toplevel
  recorder = Recorder()
  old_argv, sys.argv = sys.argv, argv
  threading.setprofile(recorder)
  sys.setprofile(recorder)
  try:
    main_lib.run()
  except SystemExit as e:
    if e.code not in (None, 0):
      raise RuntimeError(f"{' '.join(argv)} ended with status {e.code}") from None
  finally:
    sys.setprofile(None)
    threading.setprofile(None)
    sys.argv = old_argv
  return recorder.trace


def report(counted: dict[str, Any]) -> str:
  lines = ["visits per module (layer):"]
  for module, n in counted["visits"].items():
    lines.append(f"  {n:4d}  {module} ({LAYER_NAMES[layer_of(module)]})")
  lines.append(f"climbs: {counted['num_climbs']} (goal <= {GOAL_CLIMBS}); most visits to one "
               f"module: {counted['most_visits']} (goal <= {GOAL_VISITS})")
  for c in counted["climbs"]:
    lines.append(f"  {c['from']}.{c['from_function']} -> {c['to']}.{c['to_function']}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/pi_attention.py")
  parser.add_argument("--steps", type=int, default=2)
  parser.add_argument("--out", default="", help="the JSON's path ('' = none)")
  parser.add_argument("overrides", nargs="*", help="more --config.<field>=<value> (after --)")
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as workdir:
    trace = route(args.config, args.steps, args.overrides, os.path.join(workdir, "run"))
  counted = count(trace)
  counted.update(calls=len(trace), config=args.config, steps=args.steps,
                 overrides=args.overrides, layers=LAYERS, layer_names=LAYER_NAMES,
                 trace=[f"{module}:{function}" for module, function in trace])
  print(report(counted), file=sys.stderr)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(counted, f, indent=1)
      f.write("\n")
  return counted


if __name__ == "__main__":
  main()
