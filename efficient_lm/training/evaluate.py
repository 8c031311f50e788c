"""Evaluation during and after training: `evaluate` scores a whole split (every token once) with
the sharded eval step (`make_sharded_eval_step`), its batches placed on the mesh by `place_batch`
(the loop's train batches too). Loss, perplexity and bits per byte (`metrics.loss_figures`).
"""

import logging
import time
from typing import Callable

import jax
import numpy as np

from efficient_lm import data
from efficient_lm.config.run import RunConfig
from efficient_lm.ops import ring
from efficient_lm.parallel import sharding
from efficient_lm.state import train_state
from efficient_lm.training import metrics as metrics_lib
from efficient_lm.training import step as train_step_lib

log = logging.getLogger(__name__)


def place_batch(batch: dict, mesh: jax.sharding.Mesh, layout: str = "natural",
                rows: tuple[int, int, int] | None = None) -> dict:
  """A host batch on the mesh, in the model's sequence layout (`ops.ring`: 'zigzag' adds the
  positions RoPE needs; the loss, a sum over positions, is unchanged by the permutation); with
  `rows` (first, last, global size) the batch holds only this process's rows."""
  return sharding.shard_batch(ring.permute_batch(batch, mesh.shape["context"], layout), mesh, rows)


def evaluate(eval_step, params, corpus, split: str, batch_size: int, mesh,
             layout: str = "natural", max_tokens: int = 0,
             rows: tuple[int, int] | None = None,
             should_stop: Callable[[], bool] | None = None) -> dict[str, float] | None:
  """Loss (nats/token), perplexity and bits per byte over the whole split, every token once (or
  its first windows holding at least `max_tokens` targets: `train.eval_tokens`).

  A model that scores only the last positions of each window (Perceiver-AR)
  is charged the bytes of the tokens it scored: the split's bytes times the
  fraction of target tokens scored (an estimate; exact when all are scored).
  A long evaluation says how far it is about every 30 s. `should_stop()` is asked before every
  batch (by every process alike); when it says so the evaluation stops and returns None. A split
  with no text is not scored (its figures null, with the reason); bits per byte is null where the
  tokenizer does not give the split's text back (`data.bits_per_byte_withheld`).
  """
  empty = data.without_text(corpus, split)
  if empty:
    return metrics_lib.not_evaluated(f"not evaluated: the {split} split {empty}")
  total_nll, scored, targets = 0.0, 0.0, 0.0
  truncated = False
  last_note = time.monotonic()
  share = {} if rows is None else dict(batch_size=rows[1] - rows[0],
                                       process_index=jax.process_index(),
                                       process_count=jax.process_count())
  global_batch = batch_size if rows is None else (rows[1] - rows[0]) * jax.process_count()
  for index, batch in enumerate(corpus.eval_batches(split, **({"batch_size": batch_size} | share))):
    if should_stop is not None and should_stop():
      return None
    placed = place_batch(batch, mesh, layout, None if rows is None else (*rows, batch_size))
    nll, weight = eval_step(params, placed)
    total_nll += float(nll)
    scored += float(weight)
    targets += (float(np.sum(batch["weights"])) if rows is None else
                _targets_in_batch(corpus, split, index, global_batch))
    if time.monotonic() - last_note > 30:
      last_note = time.monotonic()
      log.info("... evaluating on %s: %s tokens so far", split, f"{int(targets):,}")
    if max_tokens and targets >= max_tokens:
      truncated = True
      break
  share = targets / corpus.num_tokens(split) if truncated else 1.0  # of the split's bytes
  num_bytes = corpus.num_bytes(split) * share * (scored / targets if targets else 1.0)
  figures = metrics_lib.loss_figures(total_nll, scored, num_bytes,
                                     data.bits_per_byte_withheld(corpus, split))
  return {f"eval_{name}": value for name, value in figures.items()}


def _targets_in_batch(corpus, split: str, index: int, global_batch: int) -> float:
  """Target tokens in global evaluation batch `index` (the windows of every process's rows): the
  same count on every process, whatever rows each holds."""
  seq_len, last = corpus.seq_len, corpus.num_tokens(split)  # targets are positions 1..last
  starts = (index * global_batch + np.arange(global_batch, dtype=np.int64)) * seq_len
  return float(np.clip(last - starts, 0, seq_len).sum())


def make_sharded_eval_step(run: RunConfig, built: train_state.Built):
  """The eval step with the train state's parameter shardings and the batch's."""
  return train_step_lib.make_eval_step(built.graphdef, params_shardings=built.shardings.params,
                                       batch_sharding=sharding.batch_sharding(built.mesh),
                                       loss_chunk=run.train.loss_chunk,
                                       activation_rules=run.mesh.activation_axes)
