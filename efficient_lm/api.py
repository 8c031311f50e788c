"""`efficient_lm.load(path)`: a trained model, from a workdir or an export, to score and sample.

    import efficient_lm
    lm = efficient_lm.load("runs/pi_attention")      # a training workdir: its latest checkpoint
    lm = efficient_lm.load("exports/pi_attention")   # or what `python -m efficient_lm.export` wrote
    lm.logits(ids_BT)                  # int [B, T] -> float32 [B, T, V]
    lm.score(["To be, or not to be"])  # nats/token and bits per byte, per text and overall
    lm.generate(["ROMEO:\\n"], max_new_tokens=50)

A workdir's checkpoint is restored onto one device (the first of jax's default backend) whatever
mesh saved it; an export's safetensors are read by name against the model its config.json
describes, so a file written elsewhere with the same names and shapes loads the same way
(`inference.restore`, the one way to a trained model; docs/using_a_model.md).

`efficient_lm.train(config, workdir)` is the way to one from Python (a notebook, a script): the
config a config file's `get_config()` returns, edited as the `--config.*` overrides would, made a
`RunConfig` once and checked as the training command checks it (docs/operations.md).
"""

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from efficient_lm import families
from efficient_lm.config import run as config_run
from efficient_lm.data import corpus as corpus_lib
from efficient_lm.data import round_trip
from efficient_lm.evaluation import scoring
from efficient_lm.inference import generation
from efficient_lm.inference import restore as restore_lib
from efficient_lm.inference.export_format import LoadError, is_export
from efficient_lm.runtime import progress
from efficient_lm.state import checkpoint
from efficient_lm.state import workdir as workdir_lib
from efficient_lm.training import loop as training_loop
from efficient_lm.training import metrics as metrics_lib
from efficient_lm.training import prepare as config_check


def load(path: str, *, step: int | None = None) -> "LoadedModel":
  """The model, tokenizer and config of a training workdir (its latest checkpoint, or `step`) or
  of a folder `python -m efficient_lm.export` wrote (or any folder holding `model.safetensors` or
  `model.safetensors.index.json` with a config.json and a tokenizer file)."""
  try:
    return LoadedModel(restore_lib.restore(path, step=step))
  except (workdir_lib.WorkdirError, checkpoint.NoRestorableCheckpointError) as e:
    raise LoadError(str(e)) from e


def train(config: Mapping | config_run.RunConfig, workdir: str) -> dict:
  """Trains `config` in `workdir` as `python -m efficient_lm.main --config=... --workdir=...`
  does (a workdir holding the run's checkpoints continues it) and returns the final evaluation
  (the command's result line). `config`: what a config file's `get_config()` returns (edited as
  `--config.*` overrides would) or a `RunConfig`. It is typed and checked once, as the command
  checks it, before any data is prepared or anything compiles: each mistake a `ConfigError` or a
  `WorkdirError` naming the field or the folder and the fix. Progress shows without any set-up."""
  run = config if isinstance(config, config_run.RunConfig) else config_run.build(
      config, families.CLASSES)
  workdir_lib.check_usable(workdir, run)  # the folder, then what config.json and data.json answer
  workdir_lib.Workdir(workdir).check_before_start(run)
  run, built = config_check.prepare(run)  # the edge: every check that needs the devices or data
  return training_loop.train_and_evaluate(run, workdir, built)


class LoadedModel:
  """A trained model with its tokenizer and config (`load`), to score and sample.

  Attributes: `model` (the nnx module), `tokenizer`, `config` (the run's `RunConfig`), `step` (the
  checkpoint's; None for an export written elsewhere without one), `seq_len` (the context the
  model was trained on), `eos_id` (the end-of-document id that starts every document), `path`;
  `restored`, what `inference.restore` gave.
  """

  def __init__(self, restored: restore_lib.Restored):
    self.restored = restored
    self.model = restored.model
    self.tokenizer = restored.tokenizer
    self.config = restored.config
    self.step = restored.step
    self.path = restored.path
    self.seq_len = restored.seq_len
    self.eos_id = restored.eos_id
    self._graphdef, self._params = nnx.split(self.model)
    self._score_step = None
    graphdef = self._graphdef

    @jax.jit
    def logits(params, tokens_BT, segment_ids_BT):
      model = nnx.merge(graphdef, params)
      return model(tokens_BT, segment_ids_BT=segment_ids_BT).astype(jnp.float32)

    self._logits = logits  # one compile per input shape

  @property
  def num_params(self) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(self._params))

  def __repr__(self) -> str:
    return (f"LoadedModel({self.config.model.name} at step {self.step} from {self.path}: "
            f"{self.num_params:,} parameters, seq_len {self.seq_len})")

  # Logits.

  def logits(self, token_ids) -> np.ndarray:
    """float32 `[B, T', V]` logits for int token ids `[B, T]` (T <= seq_len): every position, or
    the last T' a Perceiver-AR model predicts. Give each document's end-of-document token
    (`eos_id`) before it, as training did; with `data.document_mask` (the default) the positions
    attend within the documents those tokens delimit, as in training."""
    ids_BT = np.asarray(token_ids)
    if ids_BT.ndim != 2 or not np.issubdtype(ids_BT.dtype, np.integer) or 0 in ids_BT.shape:
      raise ValueError(f"token_ids must be a non-empty int array [batch, tokens] (got shape "
                       f"{ids_BT.shape}, dtype {ids_BT.dtype}); wrap one sequence as [ids]")
    if ids_BT.shape[1] > self.seq_len:
      raise ValueError(f"token_ids has {ids_BT.shape[1]} tokens a row, more than the model's "
                       f"seq_len={self.seq_len}; cut the rows, or use .score, which windows long "
                       "texts")
    vocab = self.config.model.vocab_size
    if ids_BT.min() < 0 or ids_BT.max() >= vocab:
      bad = ids_BT.min() if ids_BT.min() < 0 else ids_BT.max()
      raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab}); encode "
                       "text with .tokenizer")
    ids_BT = ids_BT.astype(np.int32)
    segments_BT = None
    if self.config.data.document_mask:
      segments_BT = jnp.asarray(corpus_lib.document_ids(ids_BT, self.eos_id))
    return np.asarray(self._logits(self._params, jnp.asarray(ids_BT), segments_BT))

  # Scoring.

  def score(self, texts: Sequence[str], *, batch_size: int | None = None) -> dict:
    """Loss (nats/token), perplexity and bits per byte of each text and of all of them together.

    Each text is one document, scored as `python -m efficient_lm.evaluate --text_file` scores a
    file: the stream [eos] + its tokens + [eos], in windows of `seq_len` tokens, every target
    once, through `scoring`'s windows and score step (compiled once for all the texts; the
    windows are built a batch at a time, so any number of texts fits).
    Returns {"texts": [{loss, perplexity, bits_per_byte, tokens, bytes}, ...], and the same
    figures over all texts}; `tokens` counts the scored targets. Bits per byte is None, with
    `bits_per_byte_reason`, where the tokenizer does not give the text back (`data.round_trip`).
    A call longer than 20 s says how far it is on stderr (`progress.phase`)."""
    if isinstance(texts, str):
      raise ValueError("texts must be a list of strings; wrap one text as [text]")
    texts = list(texts)
    if not texts:
      raise ValueError("texts is empty; give at least one text to score")
    batch_size = batch_size or self.config.data.batch_size
    scoring._check_positive_int("batch_size", batch_size)  # pylint: disable=protected-access
    seq_len, eos, pad = self.seq_len, self.eos_id, int(self.tokenizer.pad_id)
    num_logits = scoring.predicted_positions(self.model, seq_len)
    scoring.check_windows(seq_len, seq_len, seq_len=seq_len, num_logits=num_logits,
                          model_name=f"model.name={self.config.model.name!r}")
    if self._score_step is None:
      self._score_step = scoring.make_score_step(
          self._graphdef, loss_chunk=self.config.train.loss_chunk, per_token=True)
    layout = dict(context=seq_len, stride=seq_len, seq_len=seq_len, right_align=False, eos_id=eos,
                  pad_id=pad, document_mask=bool(self.config.data.document_mask))
    for i, text in enumerate(texts):  # every refusal before any work
      if not isinstance(text, str) or not text:
        raise ValueError(f"texts[{i}] is {'empty' if text == '' else type(text).__name__}; give "
                         "non-empty strings")
    nll_N, scored_N = np.zeros(len(texts)), np.zeros(len(texts))  # per text, float64 on the host
    targets, num_bytes, measured = [], [], []
    pending, owners = [], []  # rows not yet scored, a batch at a time, and their texts

    def run(rows: dict, owner_R: np.ndarray) -> None:
      if len(owner_R) < batch_size:  # the last batch: rows of weight 0 (window ids past the end)
        extra = scoring.window_batch(np.asarray([eos, eos], np.int32),
                                     np.arange(1, 1 + batch_size - len(owner_R)), **layout)
        rows = {k: np.concatenate([rows[k], extra[k]]) for k in rows}
      out = jax.device_get(self._score_step(self._params, rows))
      T = out["token_nll"].shape[1]
      weights_RT = rows["weights"][:len(owner_R), -T:]
      token_nll_RT = np.asarray(out["token_nll"], np.float64)[:len(owner_R)]
      np.add.at(nll_N, owner_R, (token_nll_RT * weights_RT).sum(1))
      np.add.at(scored_N, owner_R, weights_RT.sum(1))

    status = lambda: (f"{len(targets):,} of {len(texts):,} texts read, "
                      f"{int(scored_N.sum()):,} tokens scored")
    with progress.phase(f"scoring {len(texts):,} text(s)", status=status):
      for i, text in enumerate(texts):
        tokens = np.concatenate([[eos], self.tokenizer.encode(text), [eos]]).astype(np.int32)
        windows = scoring.num_windows(len(tokens) - 1, seq_len)
        pending.append(scoring.window_batch(tokens, np.arange(windows), **layout))
        owners.append(np.full(windows, i))
        targets.append(len(tokens) - 1)
        num_bytes.append(len(text.encode("utf-8")))
        measured.append(round_trip.measure(self.tokenizer, tokens, [text]))
        while sum(map(len, owners)) >= batch_size or (i == len(texts) - 1 and owners):
          rows = {k: np.concatenate([b[k] for b in pending]) for k in pending[0]}
          owner_R = np.concatenate(owners)
          run({k: v[:batch_size] for k, v in rows.items()}, owner_R[:batch_size])
          rest = {k: v[batch_size:] for k, v in rows.items()}
          left = len(owner_R) > batch_size
          pending, owners = ([rest], [owner_R[batch_size:]]) if left else ([], [])
    per_text, total_nll, total_scored, total_bytes = [], 0.0, 0.0, 0.0
    for i in range(len(texts)):
      nll, scored = float(nll_N[i]), float(scored_N[i])
      charged = num_bytes[i] * scored / targets[i]  # bytes of the scored share (latents only)
      per_text.append({**metrics_lib.loss_figures(nll, scored, charged,
                                                  round_trip.withheld(measured[i], "scored")),
                       "tokens": int(round(scored)), "bytes": num_bytes[i]})
      total_nll, total_scored, total_bytes = (total_nll + nll, total_scored + scored,
                                              total_bytes + charged)
    withheld = round_trip.withheld(round_trip.total(measured), "scored")
    return {"texts": per_text, **metrics_lib.loss_figures(total_nll, total_scored, total_bytes,
                                                          withheld),
            "tokens": int(round(total_scored)), "bytes": int(sum(num_bytes))}

  # Generation.

  def generate(self, prompts, max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 40,
               top_p: float = 1.0, seed: int = 0, stop: Sequence[str] | None = None):
    """The continuation of each prompt (the new text only), all prompts decoded together by
    `generation.generate_batch` (the cached decoder): up to `max_new_tokens` tokens, `temperature`
    0 = greedy, `top_k` 0 and `top_p` 1 = no cut; each prompt a document's start. A continuation
    ends at the end-of-document token (not in the text) or once it holds a string of `stop` (cut
    before it: `generation.generate_texts`, whose `tokens` end with the token that completed it).
    A list of prompts gives a list of texts; one string, one text. A call longer than 20 s says
    how far it is on stderr (`progress.phase`)."""
    one = isinstance(prompts, str)
    prompts = [prompts] if one else list(prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
      raise ValueError("prompts must be a string or a non-empty list of strings")
    generation.check_sampling(temperature, top_k, top_p)
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
      raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stop):
      raise ValueError(f"stop={stop!r} must be non-empty strings")
    texts = [g.continuation for g in generation.generate_texts(
        self.model, self.tokenizer, prompts, num_tokens=max_new_tokens,
        document_mask=bool(self.config.data.document_mask), seed=seed, temperature=temperature,
        top_k=top_k, top_p=top_p, stop=stop)]
    return texts[0] if one else texts


__all__ = ["LoadError", "LoadedModel", "is_export", "load"]
