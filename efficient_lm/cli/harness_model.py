"""lm-eval's `LM` over a trained model (`efficient_lm.load`), registered as "efficient_lm".

    import lm_eval
    from efficient_lm.cli.harness_model import EfficientLM
    lm_eval.simple_evaluate(model=EfficientLM("runs/pi_attention"), tasks=["hellaswag"])

What each request type does: `efficient_lm.harness` (the command) and docs/using_a_model.md.
"""

import os

import numpy as np
from flax import nnx
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

import efficient_lm
from efficient_lm.data import corpus as corpus_lib
from efficient_lm.evaluation import score_rows
from efficient_lm.evaluation import scoring

MODEL_NAME = "efficient_lm"  # lm-eval's registry key


class HarnessError(ValueError):
  """A request or run the adapter cannot serve; the message says why and what to do."""


@register_model(MODEL_NAME)
class EfficientLM(LM):
  """lm-eval's three request types over a loaded model (`efficient_lm.load`).

  `model`: a training workdir or an export folder (or an already loaded model); lm-eval's
  `--model_args` may give it as `path=`, `workdir=` or `pretrained=`. `batch_size`: rows per
  step (windows of seq_len tokens) and prompts per generation call. `seed`: sampling seed of
  `generate_until` requests with `do_sample`."""

  def __init__(self, model=None, *, path=None, workdir=None, pretrained=None, step=None,
               batch_size=8, seed=0, max_batch_size=None, device=None):
    del max_batch_size, device  # (lm-eval passes them; this runs on jax's default device)
    super().__init__()
    model = model or path or workdir or pretrained
    if model is None:
      raise HarnessError("no model: give a training workdir or an export folder (model_args "
                         "path=DIR)")
    if isinstance(model, (str, os.PathLike)):
      model = efficient_lm.load(str(model), step=None if step is None else int(step))
    self.lm = model
    if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
      batch_size = 8
    self.batch_size = int(batch_size)
    if self.batch_size < 1:
      raise HarnessError(f"batch_size={self.batch_size} must be at least 1")
    self.seed = int(seed)
    self.seq_len, self.eos_id = int(self.lm.seq_len), int(self.lm.eos_id)
    self.pad_id = int(self.lm.tokenizer.pad_id)
    self.document_mask = bool(self.lm.config.data.document_mask)
    self.num_logits = scoring.predicted_positions(self.lm.model, self.seq_len)
    self.right_align = self.num_logits < self.seq_len  # Perceiver-AR: targets in the latents
    graphdef, self._params = nnx.split(self.lm.model)
    self._step = score_rows.make_score_step(
        graphdef, loss_chunk=int(self.lm.config.train.loss_chunk), predictions=True)

  @property
  def tokenizer_name(self) -> str:
    return f"{MODEL_NAME}:{getattr(self.lm, 'path', '')}"

  def _encode(self, text: str) -> list[int]:
    return [int(t) for t in self.lm.tokenizer.encode(text)] if text else []

  def _score_rows(self, rows: list[dict], what: str = "",
                  disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    """(summed log-probability of the weighted targets, every weighted target the argmax) of
    each `[seq_len]` row, through the one scoring loop (`evaluation.score_rows`: `batch_size`
    rows a step, the last batch padded with rows of weight 0, one compiled shape); how far it is
    goes to stderr every 20 s unless lm-eval says `disable_tqdm`."""
    scored = score_rows.score_rows(self._step, self._params, rows, batch_size=self.batch_size,
                                   progress=None if disable_tqdm else f"lm-eval {what}".rstrip(),
                                   total=len(rows))
    return [(-row.nll, row.all_right()) for row in scored]

  def _row(self, inputs: list[int], targets: list[int], scored: int) -> dict:
    """One `[seq_len]` row: `inputs` (at most seq_len) and their `targets`, the last `scored`
    targets weighted; padded on the right, or (Perceiver-AR) on the left with end-of-document
    tokens, as `scoring.window_batch` lays out its windows."""
    L, m = self.seq_len, len(inputs)
    offset = L - m if self.right_align else 0
    row = {"inputs": np.full(L, self.eos_id if self.right_align else self.pad_id, np.int32),
           "targets": np.full(L, self.pad_id, np.int32), "weights": np.zeros(L, np.float32)}
    row["inputs"][offset:offset + m] = inputs
    row["targets"][offset:offset + m] = targets
    row["weights"][offset + m - scored:offset + m] = 1.0
    return self._with_segments(row)

  def _with_segments(self, row: dict) -> dict:
    """The row with its document ids (`segment_ids`, as training saw them) where the model attends
    within documents (`data.document_mask`)."""
    if self.document_mask:
      row["segment_ids"] = corpus_lib.document_ids(row["inputs"][None], self.eos_id)[0]
    return row

  def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: trailing spaces of the context go to the continuation; the continuation's
    ids are those of context + continuation after the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = self._encode(context + continuation)
    ctx = self._encode(context)
    return ctx, whole[len(ctx):]

  def loglikelihood(self, requests, disable_tqdm: bool = False):
    rows, where, results = [], [], []
    for i, request in enumerate(requests):
      context, continuation = request.args
      ctx, cont = self._encode_pair(context, continuation)
      if not cont:
        results.append((0.0, True))
        continue
      if len(cont) > self.num_logits:
        raise HarnessError(
            f"a continuation of {len(cont)} tokens ({continuation[:40]!r}...) is longer than the "
            f"{self.num_logits} positions {self.lm.config.model.name} predicts in one window "
            "(model.seq_len, or Perceiver-AR's latents): lm-eval's loglikelihood scores a "
            "continuation whole; use a task with shorter continuations, or a longer model")
      full = [self.eos_id] + ctx + cont
      rows.append(self._row(full[:-1][-self.seq_len:], full[1:][-self.seq_len:], len(cont)))
      where.append(i)
      results.append(None)
    for i, scored in zip(where, self._score_rows(rows, "loglikelihood", disable_tqdm)):
      results[i] = scored
    for request, result in zip(requests, results):
      self.cache_hook.add_partial("loglikelihood", request.args, result)
    return results

  def rolling_rows(self, text: str) -> list[dict]:
    """The windows of the stream [eos] + text: `scoring.window_batch`'s, seq_len inputs each
    scoring its last `stride` targets (seq_len; Perceiver-AR: its latents), every token once."""
    tokens = np.asarray([self.eos_id] + self._encode(text), np.int32)
    if len(tokens) < 2:
      return []
    stride = self.num_logits if self.right_align else self.seq_len
    layout = dict(context=self.seq_len, stride=stride, seq_len=self.seq_len,
                  right_align=self.right_align, eos_id=self.eos_id, pad_id=self.pad_id)
    batch = scoring.window_batch(tokens, np.arange(scoring.num_windows(len(tokens) - 1, stride)),
                                 **layout)
    return [self._with_segments({k: batch[k][b] for k in ("inputs", "targets", "weights")})
            for b in range(len(batch["inputs"]))]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    rows, owner = [], []
    for i, request in enumerate(requests):
      windows = self.rolling_rows(request.args[0])
      rows += windows
      owner += [i] * len(windows)
    results = [0.0] * len(requests)
    for i, (logprob, _) in zip(owner, self._score_rows(rows, "loglikelihood_rolling",
                                                      disable_tqdm)):
      results[i] += logprob
    for request, result in zip(requests, results):
      self.cache_hook.add_partial("loglikelihood_rolling", request.args, result)
    return results

  def _fit_prompt(self, context: str, room: int) -> str:
    """`context`, cut on the left to at most `room` tokens."""
    ids = self._encode(context)
    keep = room
    while len(ids) > room and keep > 0:
      context = self.lm.tokenizer.decode(np.asarray(ids[-keep:], np.int32))
      if len(self._encode(context)) <= room:
        break
      keep -= 1
    return context

  def generate_until(self, requests, disable_tqdm: bool = False):
    del disable_tqdm
    groups: dict = {}
    for i, request in enumerate(requests):
      context, kwargs = request.args
      kwargs = dict(kwargs or {})
      until = kwargs.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      new = int(kwargs.pop("max_gen_toks", 256))
      sample = bool(kwargs.pop("do_sample", False))
      temperature = float(kwargs.pop("temperature", 0.0)) if sample else 0.0
      if sample and temperature == 0.0:
        temperature = 1.0
      top_k, top_p = int(kwargs.pop("top_k", 0) or 0), float(kwargs.pop("top_p", 1.0) or 1.0)
      new = max(1, min(new, self.seq_len - 2))  # inside the trained window, prompt included
      key = (tuple(until), new, temperature, top_k if sample else 0, top_p if sample else 1.0)
      groups.setdefault(key, []).append((i, context))
    results = [None] * len(requests)
    for (until, new, temperature, top_k, top_p), items in groups.items():
      room = self.seq_len - 1 - new  # the end-of-document token, the prompt, the new tokens
      for first in range(0, len(items), self.batch_size):
        chunk = items[first:first + self.batch_size]
        prompts = [self._fit_prompt(context, room) for _, context in chunk]
        texts = self.lm.generate(prompts, max_new_tokens=new, temperature=temperature,
                                 top_k=top_k, top_p=top_p, seed=self.seed,
                                 stop=list(until) or None)
        for (i, _), text in zip(chunk, texts):
          results[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
    return results

