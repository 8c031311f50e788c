"""`TrainConfig`: the train section, typed: each field's default, meaning and check.

`config_base.base_config` reads the section's defaults from here and `--help` its docs;
`run.build` builds it from a config's train section (`TrainConfig.from_mapping`), which runs
every check. This module imports no jax.
"""

import dataclasses
import math

from efficient_lm.config import fields as tc

SCHEDULES = ("cosine", "wsd")  # `optimizer.SCHEDULES` (tested equal)
_ANY = math.inf


def _profile_ok(value) -> bool:
  if value == "":
    return True
  if not isinstance(value, str):
    return False
  parts = value.split(":")
  return all(p.isdigit() for p in parts) and 1 <= len(parts) <= 2 and int(parts[0]) >= 1


def _is_str(value) -> bool:
  return isinstance(value, str)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(tc.Section):
  """The train section."""
  SECTION = "train"

  num_steps: int = tc.setting(700, "optimizer steps (a resumed run continues up to this)",
                              tc.positive_int())
  learning_rate: float = tc.setting(2e-3, "peak AdamW learning rate", tc.number_in(
      0.0, _ANY, low_open=True, requirement="must be positive",
      fix="set train.learning_rate to e.g. 1e-3"))
  warmup_steps: int = tc.setting(50, "linear warmup from 0 to the peak", tc.non_negative_int(
      fix="set train.warmup_steps to e.g. 100"))
  schedule: str = tc.setting("cosine", "'cosine': decay to 10% of the peak at num_steps; 'wsd': "
                             "constant, then linear decay to 10% over the last decay_fraction "
                             "(extendable)", tc.one_of(SCHEDULES, "is not a known schedule"))
  decay_fraction: float = tc.setting(0.2, "wsd: the fraction of num_steps spent decaying",
                                     tc.number_in(0.0, 1.0, low_open=True,
                                                  fix="set train.decay_fraction to e.g. 0.2"))
  weight_decay: float = tc.setting(0.1, "AdamW decoupled decay of every kernel and embedding "
                                   "table; norm scales, biases and Perceiver-AR's compression map "
                                   "do not decay", tc.number_in(
                                       0.0, _ANY, requirement="must be >= 0",
                                       fix="set train.weight_decay to e.g. 0.1"))
  grad_clip: float = tc.setting(1.0, "global gradient-norm clip", tc.number_in(
      0.0, _ANY, requirement="must be >= 0 (0 = no clipping)",
      fix="set train.grad_clip to e.g. 1.0"))
  grad_accum_steps: int = tc.setting(1, "microbatches per step (summed in a scan: less memory, "
                                     "same loss and gradients); must divide the per-device batch",
                                     tc.positive_int())
  loss_chunk: int = tc.setting(8192, "positions per chunk of the head + loss (0 = all at once); a "
                               "chunk never holds more than [batch, loss_chunk, vocab] logits "
                               "(windows of at most this many tokens are not chunked)",
                               tc.non_negative_int(
                                   "must be an integer >= 0 (0 = the whole window at once)",
                                   "set train.loss_chunk to e.g. 4096, or 0"))
  log_every: int = tc.setting(50, "steps between train-metric lines", tc.positive_int())
  eval_every: int = tc.setting(350, "steps between evaluations on train.eval_split",
                               tc.positive_int())
  checkpoint_every: int = tc.setting(350, "steps between checkpoints", tc.positive_int())
  keep_checkpoints: int = tc.setting(3, "how many recent checkpoints to keep", tc.positive_int())
  seed: int = tc.setting(0, "parameter init, data order and dropout", tc.Check(
      lambda v: isinstance(v, int) and not isinstance(v, bool), "must be an integer",
      "set train.seed=0"))
  eval_split: str = tc.setting("validation", "held-out split for periodic and final eval (one of "
                               "the dataset's splits)")  # checked against data.dataset's splits
  eval_tokens: int = tc.setting(0, "cap on the tokens a periodic evaluation scores (0 = the whole "
                                "split); the final evaluation always scores all of it",
                                tc.non_negative_int("must be an integer >= 0 (0 = the whole "
                                                    "split)",
                                                    "set train.eval_tokens to e.g. 100000, or 0"))
  profile_steps: str = tc.setting("", "'START:END': a jax.profiler trace of those steps into "
                                  "<workdir>/profile (TensorBoard's profile tab, Perfetto)",
                                  tc.Check(_profile_ok, "must be '' or 'START:END' (steps, from 1)",
                                           "set train.profile_steps='10:12', or ''"))
  compilation_cache_dir: str = tc.setting(
      "~/.cache/efficient_lm/jax_cache", "persistent compilation cache (a rerun skips compiling "
      "the same step); '' = off", tc.Check(_is_str, "must be a path or ''",
                                          "set train.compilation_cache_dir='' (off) or a folder"))
  allow_new_data: bool = tc.setting(False, "resume a workdir's checkpoints on another corpus or "
                                    "tokenizer (deliberate fine-tuning; the old tokenizer file is "
                                    "kept)", tc.boolean("set train.allow_new_data=False"))
  sample_prompt: str = tc.setting("ROMEO:\n", "prompt of the sample printed at the end ('' = "
                                  "none)", tc.Check(_is_str, "must be a string",
                                                    "set train.sample_prompt='' (no sample)"))
  sample_tokens: int = tc.setting(64, "tokens generated for that sample", tc.non_negative_int(
      "must be >= 0", "set train.sample_tokens to 0 to skip the final sample"))
  # W&B (with train.wandb on, `training.wandb.check_installed` also needs the package).
  wandb: bool = tc.setting(False, "also log metrics.jsonl's figures and the config to W&B (wandb "
                           "extra)", tc.boolean("set train.wandb=True to log to W&B, or False"))
  wandb_project: str = tc.setting(
      "efficient_lm", "the W&B project of the run",
      tc.Check(lambda v: _is_str(v) and v.strip() != "", "must be a non-empty string",
               "set train.wandb_project=efficient_lm"))
  wandb_run_name: str = tc.setting("", "the W&B run's display name ('' = W&B picks one)",
                                   tc.Check(_is_str, "must be a string",
                                            "set {field}='' (or e.g. 'a,b' for tags)"))
  wandb_tags: str = tc.setting("", "comma-separated W&B tags, e.g. 'pi,ablation'",
                               tc.Check(_is_str, "must be a string",
                                        "set {field}='' (or e.g. 'a,b' for tags)"))


__all__ = ["SCHEDULES", "TrainConfig"]
