"""Where figures go: `metrics.jsonl`, TensorBoard event files and the console."""

import json
import math
import os
import time

import tensorboardX

from efficient_lm.config.run import RunConfig
from efficient_lm.runtime import figures
from efficient_lm.training import wandb as wandb_writer


def bits_per_byte(sum_nll_nats: float, num_bytes: int) -> float:
  """Summed NLL (nats) of every target token of a split / (ln 2 * the split's UTF-8 bytes)."""
  return sum_nll_nats / (math.log(2.0) * num_bytes)


def loss_figures(sum_nll_nats: float, scored: float, num_bytes: float,
                 withheld: str | None = None) -> dict:
  """The three figures of an evaluation: loss (nats per scored token), perplexity and bits per
  byte (`num_bytes`: the UTF-8 bytes of what was scored). Bits per byte is null, with
  `bits_per_byte_reason`, where `withheld` says why (a tokenizer that does not give the scored
  text back: `data.round_trip`) or no byte was scored; all three are null where no token was."""
  if not scored > 0:
    return {**figures.withheld("loss", "no token was scored"),
            **figures.withheld("perplexity", "no token was scored"),
            **figures.withheld("bits_per_byte", withheld or "no token was scored")}
  loss = sum_nll_nats / scored
  withheld = withheld or (None if num_bytes > 0 else "no byte of text was scored")
  return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)),
          **(figures.withheld("bits_per_byte", withheld) if withheld else
             {"bits_per_byte": bits_per_byte(sum_nll_nats, num_bytes)})}


def not_evaluated(reason: str, prefix: str = "eval_") -> dict:
  """An evaluation's figures where it could not run (a split with no text): each null, and why."""
  return {k: v for name in ("loss", "perplexity", "bits_per_byte")
          for k, v in figures.withheld(prefix + name, reason).items()}


SUPERSEDED = "metrics.superseded.jsonl"


def rewind(workdir: str, step: int) -> int:
  """A run resumed at checkpoint `step` trains the later steps again: their lines in
  `metrics.jsonl` (written before the run was cut short) move to `metrics.superseded.jsonl`
  (appended, kept), as does a line torn by the kill, so that metrics.jsonl holds every step once. Returns how many lines moved.
  metrics.jsonl is rewritten atomically (beside, then renamed)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    return 0
  with open(path, encoding="utf-8") as f:
    lines = f.readlines()
  kept, moved = [], []
  for line in lines:
    try:
      later = int(json.loads(line)["step"]) > step
    except (ValueError, KeyError, TypeError):  # a line torn by the kill: moved too
      later = True
    (moved if later else kept).append(line if line.endswith("\n") else line + "\n")
  if not moved:
    return 0
  with open(os.path.join(workdir, SUPERSEDED), "a", encoding="utf-8") as f:
    f.writelines(moved)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(kept)
  os.replace(tmp, path)
  return len(moved)


class MetricWriter:
  """Appends one JSON object a line to `<workdir>/metrics.jsonl` and mirrors it to TensorBoard."""

  def __init__(self, workdir: str):
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
    self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: dict) -> None:
    """One line of `metrics` at `step` (strict JSON: a null figure has its reason beside it); its
    finite numbers to TensorBoard."""
    self._jsonl.write(figures.dumps({"step": int(step), **metrics}) + "\n")
    self._jsonl.flush()
    for name, value in figures.numbers(metrics).items():
      self._tb.add_scalar(name, value, int(step))
    self._tb.flush()

  def close(self) -> None:
    self._jsonl.close()
    self._tb.close()


class NullWriter:
  """What processes other than 0 write: nothing (process 0 writes the job's figures)."""

  def write(self, step: int, metrics: dict[str, float]) -> None:
    del step, metrics

  def close(self) -> None:
    pass


class FanOut:
  """Each figure to every one of `writers` (one `write` call in the loop, whatever they are)."""

  def __init__(self, *writers):
    self.writers = writers

  def write(self, step: int, metrics: dict[str, float]) -> None:
    for writer in self.writers:
      writer.write(step, metrics)

  def close(self) -> None:
    """Closes every writer, even when one fails (the first failure is raised after)."""
    failure = None
    for writer in self.writers:
      try:
        writer.close()
      except Exception as e:  # pylint: disable=broad-except
        failure = failure or e
    if failure is not None:
      raise failure


def open_writers(run: RunConfig, workdir: str, primary: bool):
  """Where the run's figures go: on process 0 `metrics.jsonl` and TensorBoard (`MetricWriter`),
  and W&B with `train.wandb` (`wandb_writer`, checked by `wandb_writer.check` before anything
  compiled); nothing on the other processes."""
  if not primary:
    return NullWriter()
  writers = [MetricWriter(workdir)]
  if run.train.wandb:
    try:
      writers.append(wandb_writer.WandbWriter(run, workdir))
    except BaseException:
      writers[0].close()
      raise
  return FanOut(*writers)


def _duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class Progress:
  """Console progress: step, loss, tokens/s and the time left, from a running rate; on
  accelerators (`peak_flops`: all the job's devices together) also tokens/s per device and the
  model FLOP utilisation of `step_flops` (`efficient_lm.training.flops`)."""

  def __init__(self, first_step: int, num_steps: int, tokens_per_step: int, *,
               step_flops: float | None = None, peak_flops: float | None = None,
               num_devices: int = 1):
    self.num_steps = num_steps
    self.tokens_per_step = tokens_per_step
    self.step_flops, self.peak_flops, self.num_devices = step_flops, peak_flops, num_devices
    self._last_step = first_step
    self._last_time = self._reset_from = time.perf_counter()
    self._step_seconds = None

  def tokens_per_sec(self, step: int) -> float:
    """Rate since the previous call (the caller has blocked on the step's result)."""
    now = time.perf_counter()
    if step <= self._last_step:  # no step since the clock was reset (right after the first step):
      now, self._last_time = self._last_time, self._reset_from  # the rate of that step, compile included
      step, self._last_step = self._last_step, self._last_step - 1
    steps = max(step - self._last_step, 1)
    seconds = max(now - self._last_time, 1e-9) / steps
    self._step_seconds = seconds if self._step_seconds is None else 0.5 * (self._step_seconds + seconds)
    self._last_step, self._last_time = step, now
    return self.tokens_per_step / seconds

  def mfu(self, tokens_per_sec: float) -> float | None:
    """Model FLOPs per second over the devices' peak, at `tokens_per_sec`; None off accelerators."""
    if not self.step_flops or not self.peak_flops:
      return None
    return self.step_flops * tokens_per_sec / self.tokens_per_step / self.peak_flops

  def line(self, step: int, loss: float, tokens_per_sec: float) -> str:
    eta = (self.num_steps - step) * (self._step_seconds or 0.0)
    mfu = self.mfu(tokens_per_sec)
    device = "" if not self.peak_flops else (
        f" ({tokens_per_sec / self.num_devices:,.0f} per device"
        f"{'' if mfu is None else f', MFU {100 * mfu:.1f}%'})")
    return (f"step {step}/{self.num_steps}  loss {loss:.4f}  {tokens_per_sec:,.0f} tokens/s{device}  "
            f"ETA {_duration(eta)}")

  def reset_clock(self, step: int) -> None:
    """Excludes evaluation or checkpoint time (or the first step's compilation) from the next rate."""
    self._reset_from = self._last_time
    self._last_step, self._last_time = step, time.perf_counter()
