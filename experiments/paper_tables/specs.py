"""The tables: their shared settings, rows (config key, seeds), claims, and each row's command."""

import os
import shlex
import sys

from experiments.common import REPO, build, load_config

# Claims measured on the per-position curve, ('gain', far ranges, near ranges): a row's loss over
# the far positions minus its loss over the near ones; compared between two models on the same
# tokens, what the token mix adds to both cancels. BCMT: the first 8 positions of blocks 2-4
# (256-263, 512-519, 768-775), where HOnly has no context and BCMT its memory, against those of
# block 1. π: positions 512-2047, past the 4-layer sliding window's reach (4 x 127 = 508
# tokens), against 128-511.
BLOCK_STARTS = (((256, 264), (512, 520), (768, 776)), ((0, 8),))
PAST_REACH = (((512, 2048),), ((128, 512),))

# Perceiver-AR trained with ECP's FLOPs: ECP's train step costs 3.85x Perceiver-AR's (26.7 vs 6.93
# GFLOP per step at the ECP table's sizes, `step_gflop` in paper_tables.json), so 3.85x the steps
# (2,560 at the tables' 665).
ECP_FLOPS_FACTOR = 3.85
ecp_flops_steps = lambda steps: round(steps * ECP_FLOPS_FACTOR)
SEEDS = (0, 1, 2)  # stats.PLANNED_SEEDS["loss"], chosen before the runs (issue 33)

# Shared settings per table (`section.field` -> value, applied to every row whose config has the
# field), the rows as (config key, seeds), per-row settings (applied last: they may set the
# steps), and how rows are scored. A config key 'name:preset+variant' is the config
# 'configs/name.py:preset' with the variant's row settings (a row that differs by settings only).
# Claims: (text, A, B, metric, the paper's figure[, 'equivalence']): "A is ahead of B" (a paired
# t over seeds) or "A is comparable to B" (TOST within stats.EQUIVALENCE_MARGIN['loss']). Rows
# are scored:
# 'per_position' (every position of non-overlapping seq_len windows, loss per position) or
# 'latents' (the last num_latents targets of each window, every token once, for every model; and
# every position for the models that predict them all).
TABLES = {
    "bcmt": {
        "title": "BCMT paper: dense vs BCMT vs HOnly (the ablation) at blocks 256 and 128",
        "settings": {"data.seq_len": 1024, "data.batch_size": 2, "model.d_model": 128,
                     "model.num_layers": 6, "model.num_heads": 4},
        "rows": [("dense", SEEDS), ("bcmt:256", SEEDS), ("bcmt:honly256", SEEDS),
                 ("bcmt:128", SEEDS), ("bcmt:honly128", SEEDS)],
        "row_settings": {},
        "scoring": "per_position",
        "bands": [(0, 256), (256, 512), (512, 1024)],
        "baseline": "bcmt:honly256",
        "marks": {"block 256 boundaries": (256, 512, 768)},
        "diff_bin": 8,
        "claims": [
            ("BCMT-256 is comparable to dense (within 0.02 nats)", "bcmt:256", "dense", ("eval",),
             "4.5931 vs 4.5752: comparable, dense ahead by 0.018", "equivalence"),
            ("BCMT-256 is ahead of HOnly-256 (the memory helps)", "bcmt:256", "bcmt:honly256", ("eval",),
             "HOnly worse at every block size"),
            ("BCMT-128 is ahead of HOnly-128", "bcmt:128", "bcmt:honly128", ("eval",),
             "HOnly worse at every block size"),
            ("BCMT-256's memory is used: loss at the first 8 positions of blocks 2-4 minus at those of "
             "block 1 is lower than HOnly-256's", "bcmt:256", "bcmt:honly256", ("gain",) + BLOCK_STARTS,
             "(the memory's purpose: HOnly has no context there)"),
            ("control: dense gains there too (the same difference, dense below HOnly-256)", "dense",
             "bcmt:honly256", ("gain",) + BLOCK_STARTS, "(can this scale show a gain from context?)"),
        ],
    },
    "ecp": {
        "title": "ECP paper: Perceiver-AR vs Double vs Compressed vs s-Split vs ECP",
        "settings": {"data.seq_len": 512, "data.batch_size": 4, "model.d_model": 128,
                     "model.num_layers": 4, "model.num_heads": 4, "model.num_latents": 128,
                     "model.num_segments": 4},
        "rows": [("perceiver_ar", SEEDS), ("ecp", SEEDS), ("perceiver_ar:double", SEEDS),
                 ("perceiver_ar:compressed", SEEDS), ("perceiver_ar:ssplit", SEEDS),
                 ("perceiver_ar+ecp_flops", SEEDS)],
        "row_settings": {"perceiver_ar+ecp_flops": {  # a callable gets the table's steps
            "train.num_steps": ecp_flops_steps, "train.eval_every": ecp_flops_steps,
            "train.checkpoint_every": ecp_flops_steps,
            "train.log_every": lambda steps: max(1, ecp_flops_steps(steps) // 20)}},
        "scoring": "latents",
        "claims": [
            ("ECP is ahead of Perceiver-AR on the same positions", "ecp", "perceiver_ar", ("latents",),
             "ECP ahead"),
            (f"ECP is ahead of Perceiver-AR trained with ECP's FLOPs ({ECP_FLOPS_FACTOR}x the steps), "
             "on the same positions", "ecp", "perceiver_ar+ecp_flops", ("latents",),
             "(the compute-matched baseline the paper does not show)"),
            ("Double is ahead of Perceiver-AR", "perceiver_ar:double", "perceiver_ar", ("latents",),
             "Double ahead"),
            ("Compressed is ahead of Perceiver-AR", "perceiver_ar:compressed", "perceiver_ar", ("latents",),
             "Compressed ahead"),
            ("s-Split is ahead of Perceiver-AR", "perceiver_ar:ssplit", "perceiver_ar", ("latents",),
             "s-Split ahead"),
        ],
    },
    "pi": {
        "title": "π paper: dense vs sliding window vs π-Attention (constant and doubling periods)",
        "settings": {"data.seq_len": 2048, "data.batch_size": 1, "model.d_model": 128,
                     "model.num_layers": 4, "model.num_heads": 4, "model.window": 128,
                     "model.period": 128, "model.num_skips": 3},
        "rows": [("dense", SEEDS), ("sliding_window", SEEDS), ("pi_attention", SEEDS),
                 ("pi_attention:doubling", SEEDS), ("pi_attention+fixed_gate", SEEDS),
                 ("pi_attention+no_skips", SEEDS),
                 ("gated_deltanet", SEEDS)],  # beside them, in no claim (an exploratory row)
        # The doubling schedule from base period 64: layer periods 64, 128, 256, 512 (the preset's).
        # The confounds: the skips with a fixed gate (g = 0.5), the gate with no skips.
        "row_settings": {"pi_attention:doubling": {"model.period": 64},
                         "pi_attention+fixed_gate": {"model.gate": "fixed"},
                         "pi_attention+no_skips": {"model.num_skips": 0}},
        "scoring": "per_position",
        "bands": [(0, 128), (128, 512), (512, 2048)],
        "baseline": "sliding_window",
        "marks": {"window 128": (128,), "4-layer window reach 508": (508,)},
        "diff_bin": 32,
        "claims": [
            ("π is ahead of the sliding window", "pi_attention", "sliding_window", ("eval",),
             "perplexity 18.4 vs 20.1 (0.088 nats)"),
            ("π is comparable to dense (within 0.02 nats)", "pi_attention", "dense", ("eval",),
             "perplexity 18.4 vs 18.3 (0.005 nats)", "equivalence"),
            ("π uses context past the sliding window's reach: loss at positions 512-2047 minus at "
             "128-511 is lower than the sliding window's", "pi_attention", "sliding_window",
             ("gain",) + PAST_REACH, "(the skips' purpose)"),
            ("π doubling is ahead of the sliding window", "pi_attention:doubling", "sliding_window",
             ("eval",), "(not in the paper's tables: our growing-period reading)"),
            ("control: dense gains there (the same difference, dense below the sliding window)",
             "dense", "sliding_window", ("gain",) + PAST_REACH, "(can this scale show a gain from context?)"),
            ("π with a fixed gate (0.5) is ahead of the sliding window (the skips alone)",
             "pi_attention+fixed_gate", "sliding_window", ("eval",), "(confound: not in the paper)"),
            ("π's learned gate is ahead of a fixed gate (the gate's part)", "pi_attention",
             "pi_attention+fixed_gate", ("eval",), "(confound: not in the paper)"),
            ("π's gate without skips is ahead of the sliding window (the gate alone: the window's "
             "function, by construction)", "pi_attention+no_skips", "sliding_window", ("eval",),
             "(confound: not in the paper)"),
        ],
    },
}
# One epoch of the training plays (1,360,353 tokens) at 2,048 tokens a step.
DEFAULT_STEPS = 665
DEFAULT_RESULTS = os.path.join(REPO, "experiments", "results", "paper_tables.json")
DEFAULT_README = os.path.join(REPO, "experiments", "README.md")


def config_arg(key: str) -> str:
  """'bcmt:128' (or 'bcmt:128@1') -> 'configs/bcmt.py:128'; 'dense' -> 'configs/dense.py';
  'pi_attention+fixed_gate' -> 'configs/pi_attention.py' (a variant is row settings only)."""
  name, _, preset = key.split("@")[0].split("+")[0].partition(":")
  return f"configs/{name}.py" + (f":{preset}" if preset else "")


def row_key(config_key: str, seed: int) -> str:
  return f"{config_key}@{seed}"


def split_key(key: str) -> tuple[str, int]:
  """'bcmt:256@1' -> ('bcmt:256', 1)."""
  config_key, _, seed = key.partition("@")
  return config_key, int(seed or 0)


def all_row_keys(table: str, seeds: tuple[int, ...] | None = None) -> list[str]:
  """The table's row keys; `seeds`: those seeds for every row instead of the table's (a registered
  replication's fresh seeds: experiments/registered/)."""
  return [row_key(k, s) for k, planned in TABLES[table]["rows"] for s in (seeds or planned)]


def queue(tables: list[str], seeds: tuple[int, ...] | None = None) -> list[tuple[str, str]]:
  """(table, row key) in run order: every row's first seed, then every row's second, and so on
  (`seeds`: as in `all_row_keys`)."""
  items = [(seed, table, row_key(config_key, seed)) for table in tables
           for config_key, planned in TABLES[table]["rows"] for seed in (seeds or planned)]
  return [(table, key) for _, table, key in sorted(items, key=lambda item: item[0])]


def row_overrides(table: str, key: str, steps: int, extra: list[str]) -> dict[str, str]:
  """Every `section.field=value` the row's command sets, in order (later wins); a field the row's
  config lacks (model.window for dense) is left out."""
  config_key, seed = split_key(key)
  config = load_config(config_arg(config_key))

  def has(field: str) -> bool:
    section, _, name = field.partition(".")
    return section in config and name in config[section]

  out = {k: str(v) for k, v in TABLES[table]["settings"].items() if has(k)}
  out.update({"train.num_steps": str(steps), "train.warmup_steps": str(max(1, steps // 10)),
              "train.log_every": str(max(1, steps // 20)), "train.eval_every": str(steps),
              "train.checkpoint_every": str(steps), "train.sample_tokens": "0",
              "train.seed": str(seed)})
  out.update({k: str(v(steps) if callable(v) else v)
              for k, v in TABLES[table]["row_settings"].get(config_key, {}).items()})
  for item in extra:
    field, _, value = item.partition("=")
    if has(field):
      out[field] = value
  return out


def main_command(key: str, workdir: str, overrides: dict[str, str]) -> list[str]:
  return ([sys.executable, "-m", "efficient_lm.main", f"--config={config_arg(key)}", f"--workdir={workdir}"]
          + [f"--config.{k}={v}" for k, v in overrides.items()])


def quoted(command: list[str]) -> str:
  return " ".join(shlex.quote(c) for c in ["python"] + command[1:])


def _cast(old, value: str):
  if isinstance(old, bool):
    return value.lower() in ("1", "true")
  return type(old)(value) if old is not None else value


def configured(key: str, overrides: dict[str, str]):
  config = load_config(config_arg(key))
  for field, value in overrides.items():
    section, name = field.split(".", 1)
    if name in config[section]:
      config[section][name] = _cast(config[section][name], value)
  return config


def static_figures(key: str, overrides: dict[str, str]) -> dict:
  """Params, the compiled train step's temp memory and FLOPs (compile only, random tokens)."""
  import jax  # pylint: disable=import-outside-toplevel
  from experiments import bench_step  # pylint: disable=import-outside-toplevel
  config = build(configured(key, overrides))
  _, state, _, memory, _ = bench_step.compile_train_step(config)
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  return {"model_name": config.model.name, "params": int(num_params),
          "compiled_temp_mib": getattr(memory, "temp_size_in_bytes", float("nan")) / 2**20,
          "step_gflop": bench_step.train_step_flops(config) / 1e9}
