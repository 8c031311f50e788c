"""The score step and the one batched loop over rows of tokens that every scorer runs.

A row is a dict of `[seq_len]` arrays: `inputs`, `targets`, `weights` (1 = a scored target), and
whatever else the model reads (`segment_ids`) or the caller wants back (`window_positions`,
`stream_positions`). `score_rows(step, params, rows, batch_size=B, pad_row=...)` stacks them B at a
time, fills the last batch with `pad_row` (weight 0) so one compile serves every batch, runs the
step (`make_score_step`: the train step's chunked loss, no `[B, T, V]` logits), keeps a few batches
in flight while the host builds the next, fetches each batch once, and yields every real row's
`ScoredRow` in order (padding rows never reach one). The host's sums over rows are float64.

Its users: `scoring.score_stream` (evaluate, and its context ablation), `efficient_lm.load(...)
.score`, lm-eval's adapter (`cli.harness_model`) and the extrapolation curve
(`long_context.extrapolate`). The needle grid ranks candidate answers from a shared cache
(`needle.rank_scores`: no rows of the score step) and answers by generation; it batches its prompts
with `batches`, the same fixed-size batching.
"""

import collections
import dataclasses
import itertools
from typing import Callable, Iterable, Iterator, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from efficient_lm.runtime import progress as progress_lib
from efficient_lm.training import step as train_step

Row = dict[str, np.ndarray]
Item = TypeVar("Item")
IN_FLIGHT = 4  # batches dispatched before the host waits for the oldest


def make_score_step(graphdef, *, loss_chunk: int = 0, predictions: bool = False):
  """Jitted (params, batch) -> {"token_nll": float32 `[B, T']`, the NLL (nats) of every position
  the logits cover (the last T'), and with `predictions` "predicted": the argmax `[B, T']`},
  through the train step's loss (`train_step.token_nll`, over chunks of `loss_chunk` positions)."""

  @jax.jit
  def score_step(params, batch):
    model = nnx.merge(graphdef, params)
    x_BTD = model.hidden(batch["inputs"], segment_ids_BT=batch.get("segment_ids"))
    nll_BT, *predicted = train_step.token_nll(model, x_BTD, batch["targets"], loss_chunk,
                                              predictions=predictions)
    out = {"token_nll": nll_BT.astype(jnp.float32)}
    if predictions:
      out["predicted"] = predicted[0]
    return out

  return score_step


@dataclasses.dataclass(frozen=True)
class ScoredRow:
  """One row's scores at the T' positions the logits cover (the row's last T'): `token_nll`
  (float64 nats), `weights` (float64, the row's), `predicted` (the argmax ids, where the step gives
  them); `row`: the row as given."""
  row: Row
  token_nll: np.ndarray
  weights: np.ndarray
  predicted: np.ndarray | None = None

  @property
  def nll(self) -> float:
    """The summed NLL of the scored targets (nats)."""
    return float(np.sum(self.token_nll * self.weights))

  @property
  def scored(self) -> float:
    """The summed weight: the targets scored."""
    return float(np.sum(self.weights))

  def tail(self, key: str) -> np.ndarray:
    """`row[key]` at the positions the logits cover."""
    return self.row[key][-len(self.token_nll):]

  def all_right(self) -> bool:
    """Every scored target is the argmax (needs a step with `predictions`)."""
    return bool(np.all((self.predicted == self.tail("targets"))[self.weights > 0]))

  def add_positions(self, nll_P: np.ndarray, count_P: np.ndarray) -> None:
    """Adds the scored NLL and weight at each window position (`row["window_positions"]`) into the
    float64 sums `nll_P`, `count_P`."""
    where_T = self.tail("window_positions")
    nll_P += np.bincount(where_T, self.token_nll * self.weights, minlength=len(nll_P))
    count_P += np.bincount(where_T, self.weights, minlength=len(count_P))


def batches(items: Iterable[Item], batch_size: int,
            pad: Item) -> Iterator[tuple[list[Item], int]]:
  """(batch, real): `items` `batch_size` at a time, the last batch filled with `pad` to the same
  size (one compiled shape); `real` counts the items of the batch that are not `pad`."""
  if not (isinstance(batch_size, (int, np.integer)) and not isinstance(batch_size, bool)
          and batch_size >= 1):
    raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1")
  items = iter(items)
  while chunk := list(itertools.islice(items, int(batch_size))):
    yield chunk + [pad] * (batch_size - len(chunk)), len(chunk)


def score_rows(step: Callable, params, rows: Iterable[Row], *, batch_size: int,
               pad_row: Row | None = None, place: Callable[[Row], Row] | None = None,
               progress: str | None = None, total: int | None = None) -> Iterator[ScoredRow]:
  """Each real row's `ScoredRow`, in the order of `rows` (see the module's docstring).

  `step`: `make_score_step`'s (with `predictions` for `ScoredRow.predicted`); `pad_row`: a row of
  weight 0 with the rows' keys and shapes, filling the last batch (default: zeros shaped as the
  first row); `place`: puts a stacked batch on the devices (`sharding.shard_batch` over a mesh),
  else jax places it; `progress`: the name of a phase that says every 20 s how many rows (of
  `total`, when given) are scored (`runtime.progress.phase`; inside a caller's phase it joins that
  one's line)."""
  rows = iter(rows)
  if pad_row is None:
    first = next(rows, None)
    if first is None:
      return
    rows = itertools.chain([first], rows)
    pad_row = {k: np.zeros_like(v) for k, v in first.items()}
  if np.any(np.asarray(pad_row["weights"]) != 0):
    raise ValueError("pad_row must have weight 0 everywhere (it fills the last batch and must "
                     "score nothing)")
  done = [0]
  pending: collections.deque = collections.deque()  # (device outputs, host batch, real rows)

  def collect() -> Iterator[ScoredRow]:
    out, batch, real = pending.popleft()
    out = jax.device_get(out)  # the one fetch of the batch
    token_nll_BT = np.asarray(out["token_nll"], np.float64)
    T = token_nll_BT.shape[1]
    weights_BT = np.asarray(batch["weights"][:, -T:], np.float64)
    predicted_BT = out.get("predicted")
    for b in range(real):
      done[0] += 1
      yield ScoredRow({k: v[b] for k, v in batch.items()}, token_nll_BT[b], weights_BT[b],
                      None if predicted_BT is None else np.asarray(predicted_BT[b]))

  def run() -> Iterator[ScoredRow]:
    for chunk, real in batches(rows, batch_size, pad_row):
      batch = {k: np.stack([r[k] for r in chunk]) for k in pad_row}
      # dispatched asynchronously: the host builds the next batches while the devices score
      pending.append((step(params, place(batch) if place else batch), batch, real))
      if len(pending) > IN_FLIGHT:
        yield from collect()
    while pending:
      yield from collect()

  if progress is None:
    yield from run()
    return
  of = f" of {total:,}" if total is not None else ""
  with progress_lib.phase(progress, status=lambda: f"{done[0]:,}{of} rows scored"):
    yield from run()
