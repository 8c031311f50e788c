"""Text generation: cached, batched decoding for every model (the command line: `efficient_lm.sample`).

`generate_batch` continues many prompts of different lengths in one call; `generate` (one 1-D
prompt) is its B = 1 case, and `generate_texts` / `generate_text` its text-level wrappers (stop
strings, decoding). Every context starts with an end-of-document token, as every document does in
training; a model with a fixed `prompt_window` (the Perceiver-AR family: its history) gets it
left-padded with more of them (or cut to its last `prompt_window` tokens).

Ragged batches, with no per-row positions in the models: every row's tokens sit at the positions its
own single-prompt run gives them (BCMT's blocks, ECP's segments, π's skips and learned position
embeddings see the same positions), so row b's greedy output is the single-prompt one. The common
prefix (the shortest context's length) of all rows is prefilled in one batched pass (or in chunks
of `prefill_chunk` tokens), then one decoding step per position: at position t row b's input is its
own prompt token while t is inside its context (its prompt is read by decoding steps) and its last
sample afterwards; its new tokens are the samples from its own context's end on. The Perceiver-AR
family's contexts all fill its window, so its rows share one length and the whole prompt is one
prefill. Rows never mix: every op is per row, and row b samples with its own key stream
(`seed`, b), so no row's output depends on another row's prompt, greedy or sampled.

The decoding steps run as one jitted `lax.while_loop` per call of up to `steps_per_call` steps,
which ends early on the device once every row has met a stop id or its count; between calls the host
checks the text-level stop strings. The caches (see each model's `init_cache`) are sized for the
whole generation up front: the efficient models' are fixed by their window, blocks or segments;
the dense baseline's (and Perceiver-AR's) hold every token.

`reference_generate` is the plain uncached decoder (one full forward pass per token over a window
of `seq_len` tokens); tests compare the two.
"""

import dataclasses
import functools
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from efficient_lm import models
from efficient_lm.config.run import RunConfig
from efficient_lm.data import corpus as corpus_lib
from efficient_lm.runtime import progress


def sample_logits(logits_BV: jax.Array, key: jax.Array, *, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> jax.Array:
  """Greedy when temperature == 0; else softmax sampling from the top-k logits (k > 0) and the
  smallest set of tokens whose probability reaches top_p (top_p < 1)."""
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1)
  logits_BV = logits_BV.astype(jnp.float32) / temperature
  if top_k > 0:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
  if top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    before_BV = jnp.cumsum(jax.nn.softmax(sorted_BV, axis=-1), axis=-1) - jax.nn.softmax(sorted_BV)
    # Keep a token while the mass of the tokens ranked above it is below top_p (the first always).
    cutoff_B1 = jnp.min(jnp.where(before_BV < top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
  return jax.random.categorical(key, logits_BV, axis=-1)


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
  """Clear errors for sampling settings, before anything compiles."""
  if not temperature >= 0.0:
    raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
  if not (isinstance(top_k, int) and top_k >= 0):
    raise ValueError(f"top_k={top_k} must be an integer >= 0 (0 = no top-k cut)")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p={top_p} must be in (0, 1] (1 = no nucleus cut)")


def context_room(model: nnx.Module, prompt_len: int) -> int:
  """How many tokens can follow a prompt of `prompt_len` tokens (and the end-of-document token
  before it): unbounded with RoPE, the rest of the position table with learned positions."""
  max_positions = getattr(model, "max_positions", None)
  if max_positions is None:
    return sys.maxsize
  window = getattr(model, "prompt_window", None) or 0
  return max_positions - max(prompt_len + 1, window)


def _no_room(model: nnx.Module, longest: int, num_tokens: int, room: int) -> str:
  """Why `num_tokens` new tokens do not fit after a prompt of `longest` tokens (`room` do) in the
  learned position table, and the fix: fewer new tokens, a shorter prompt (with its length)."""
  total = model.max_positions
  window = getattr(model, "prompt_window", None) or 0  # (a prompt never takes less)
  shorter = total - 1 - num_tokens  # the longest prompt num_tokens fit after
  helps = shorter >= 1 and window + num_tokens <= total
  table = (f"the model's learned positions (model.seq_len={total} in all, the end-of-document "
           "token that starts the context included)")
  rope = "or train with model.position='rope'"
  if room >= 1:
    prompt = f", or give a prompt of at most {_tokens(shorter)}" if helps else ""
    return (f"{num_tokens} new tokens after a prompt of {longest} do not fit {table}: generate at "
            f"most {room}{prompt}, {rope}")
  if helps:
    return (f"a prompt of {longest} tokens leaves no room for new tokens in {table}: give a "
            f"prompt of at most {_tokens(shorter)} for {_tokens(num_tokens, 'new ')}, {rope}")
  most = total - max(2, window)  # after a one-token prompt
  return (f"a prompt of {longest} tokens leaves no room for new tokens in {table}, and "
          f"{num_tokens} would not fit after any prompt: give a shorter prompt and at most "
          f"{_tokens(max(most, 0), 'new ')}, {rope}")


def _tokens(count: int, kind: str = "") -> str:
  return f"{count} {kind}token{'' if count == 1 else 's'}"


def prefill(model: nnx.Module, tokens_BT: jax.Array, cache, chunk: int | None = None,
            segment_ids_BT: jax.Array | None = None):
  """(logits at the last prompt position `[B, V]`, cache): one parallel pass, or chunks of `chunk`
  tokens (the first by `prefill`, the rest by `extend`) when the prompt is longer; the head runs
  at the last position only (`last_only`).
  `segment_ids_BT`: the prompt's document ids (None: one document)."""
  T = tokens_BT.shape[1]
  first = T if chunk is None else min(chunk, T)
  ids = lambda a, b: None if segment_ids_BT is None else segment_ids_BT[:, a:b]
  logits, cache = model.prefill(tokens_BT[:, :first], cache, ids(0, first), last_only=True)
  for start in range(first, T, chunk or T):
    logits, cache = model.extend(tokens_BT[:, start:start + chunk], cache, start,
                                 ids(start, start + chunk), last_only=True)
  return logits[:, -1], cache


def _contexts(model: nnx.Module, prompts_ids, num_tokens: int, eos_id: int) -> list[list[int]]:
  """Each prompt's context: an end-of-document token and the prompt, left-padded (or cut) to the
  model's `prompt_window`; refused if `num_tokens` do not fit after the longest prompt."""
  if isinstance(prompts_ids, (str, bytes)) or not len(prompts_ids):
    raise ValueError("prompts_ids must be a non-empty list of token id lists (one a prompt)")
  arrays = [np.asarray(p) for p in prompts_ids]
  vocab = model.embed.num_embeddings
  for i, a in enumerate(arrays):
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
      raise ValueError(f"prompts_ids[{i}] has shape {a.shape} ({a.dtype}): each prompt must be a "
                       "1-D list of int token ids")
    if a.size and not 0 <= a.min() <= a.max() < vocab:
      raise ValueError(f"prompts_ids[{i}] holds ids outside 0..{vocab - 1} (model.vocab_size="
                       f"{vocab}): encode the prompt with the run's tokenizer")
  prompts = [[int(t) for t in a] for a in arrays]
  longest = max(len(p) for p in prompts)
  room = context_room(model, longest)
  if num_tokens > room:
    raise ValueError(_no_room(model, longest, num_tokens, room))
  contexts = [[eos_id] + p for p in prompts]
  window = getattr(model, "prompt_window", None)
  if window:  # left-padded with end-of-document tokens (or cut) to the model's window
    contexts = [([eos_id] * (window - len(c)) + c)[-window:] for c in contexts]
  return contexts


GREEDY_BLOCK = 128  # vocabulary entries per block of `greedy`'s first reduction


def greedy(logits_BV: jax.Array) -> jax.Array:
  """`jnp.argmax(logits_BV, axis=-1)` as int32 (the first maximum; the first NaN if any), in two
  levels: the maximum of each block of `GREEDY_BLOCK` vocabulary entries, then the first block
  holding the row's maximum (or a NaN), then the first index inside that one block. Every pass
  over the whole vocabulary is a plain reduction to `[V / GREEDY_BLOCK, B]`; the compare and the
  index search touch one block a row; the reductions run over the leading axis of the `[V, B]`
  transpose, so the transpose is never materialized. Head and choice jitted together
  (`experiments.bench_greedy`, its command and one run in experiments/results/greedy.json; 2-core
  x86 CPU, 16K vocabulary, d 256; four runs): at B = 32 (a `[B, V]` head) 1.44-1.48 ms a call
  against 2.83-2.85 for one maximum and first-index search over the whole vocabulary and
  2.87-2.95 for `jnp.argmax`; at B = 8 (the head vocabulary-major) -0.03 to +0.09 ms against the
  search and +0.05 to +0.17 against argmax; at B = 1 within 0.05 ms of both."""
  logits_VB = logits_BV.T
  V, B = logits_VB.shape
  blocks = -(-V // GREEDY_BLOCK)
  if blocks * GREEDY_BLOCK != V:  # pad with -inf: never a first maximum (a real index ties first)
    logits_VB = jnp.pad(logits_VB, ((0, blocks * GREEDY_BLOCK - V), (0, 0)),
                        constant_values=-jnp.inf)
  logits_NGB = logits_VB.reshape(blocks, GREEDY_BLOCK, B)
  block_max_NB = jnp.max(logits_NGB, axis=1)           # NaN where a block holds one
  max_B = jnp.max(block_max_NB, axis=0)
  first_index = lambda hit_XB: jnp.argmax(hit_XB, axis=0).astype(jnp.int32)  # first True
  block_B = first_index((block_max_NB == max_B) | jnp.isnan(block_max_NB))
  inside_BG = logits_NGB[block_B, :, jnp.arange(B)]    # [B, GREEDY_BLOCK]: each row's block
  offset_B = first_index(((inside_BG == max_B[:, None]) | jnp.isnan(inside_BG)).T)
  return block_B * GREEDY_BLOCK + offset_B


def _sampler(temperature: float, top_k: int, top_p: float, vocab_size: int | None):
  """`sample(logits_BV, keys_B) -> ids_B`: each row drawn with its own key (greedy: no key)."""
  def sample(logits_BV, keys_B):
    if vocab_size is not None and vocab_size < logits_BV.shape[-1]:
      logits_BV = jnp.where(jnp.arange(logits_BV.shape[-1]) < vocab_size, logits_BV, -jnp.inf)
    if temperature == 0.0:
      return greedy(logits_BV)
    one = lambda logits_V, key: sample_logits(logits_V[None], key, temperature=temperature,
                                              top_k=top_k, top_p=top_p)[0]
    return jax.vmap(one)(logits_BV, keys_B).astype(jnp.int32)
  return sample


def _row_keys(key, count_B):
  """Row b's key for its new token number count_B[b]: (seed, b, count)."""
  rows_B = jnp.arange(count_B.shape[0])
  return jax.vmap(lambda b, n: jax.random.fold_in(jax.random.fold_in(key, b), n))(
      rows_B, jnp.maximum(count_B, 0))


def _stopped(token_B, count_B, num_tokens, stop_ids: tuple):
  """Rows whose token number count_B (a new token when >= 0) is a stop id or their last."""
  done_B = count_B >= num_tokens - 1
  for stop in stop_ids:
    done_B = done_B | ((count_B >= 0) & (token_B == stop))
  return done_B


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "prefill_chunk", "settings"))
def _prefill_rows(params, context_BL, ids_BL, lengths_B, key, num_tokens, *, graphdef, max_len: int,
                  prefill_chunk: int | None, settings: tuple):
  """The common prefix (L tokens per row) through the model: (cache, each row's sample for
  position L, done per row)."""
  stop_ids, sample = settings[1], _sampler(*settings[2:])
  model = nnx.merge(graphdef, params)
  B, L = context_BL.shape
  logits_BV, cache = prefill(model, context_BL, model.init_cache(B, max_len), prefill_chunk, ids_BL)
  count_B = L - lengths_B  # the sample's number among the row's new tokens (< 0: inside its prompt)
  sample_B = sample(logits_BV, _row_keys(key, count_B))
  return cache, sample_B, _stopped(sample_B, count_B, num_tokens, stop_ids)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "settings"),
                   donate_argnames=("cache",))
def _decode_rows(params, cache, last_B, id_B, done_B, context_BM, lengths_B, start, limit, key,
                 num_tokens, *, graphdef, steps: int, settings: tuple):
  """Up to `steps` decoding steps from position `start` (the input there: row b's context token
  while inside it, else `last_B`, its last sample), ending early once every row is done or at
  position `limit`: (cache, last samples, document ids, done, samples [steps, B], steps taken)."""
  eos_id, stop_ids, sample = settings[0], settings[1], _sampler(*settings[2:])
  B, M = context_BM.shape
  # Per-layer weights sliced once per call, not at every step (`LanguageModel.decoding_view`).
  graphdef, params = nnx.split(nnx.merge(graphdef, params).decoding_view())

  def cond(carry):
    i, done_B = carry[0], carry[5]
    return (i < steps) & (start + i < limit) & ~jnp.all(done_B)

  def body(carry):  # params ride in the carry so the module is built at the body's level
    i, params, cache, last_B, id_B, done_B, out_SB = carry
    t = start + i
    prompt_B = jax.lax.dynamic_index_in_dim(context_BM, jnp.minimum(t, M - 1), axis=1,
                                            keepdims=False)
    token_B = jnp.where(t < lengths_B, prompt_B, last_B)
    if id_B is not None:  # the token's document: an end-of-document token opens the next
      id_B = id_B + (token_B == eos_id).astype(jnp.int32)
    logits_BV, cache = nnx.merge(graphdef, params).decode_step(token_B, cache, t, id_B)
    count_B = t + 1 - lengths_B
    next_B = sample(logits_BV, _row_keys(key, count_B))
    done_B = done_B | _stopped(next_B, count_B, num_tokens, stop_ids)
    return i + 1, params, cache, next_B, id_B, done_B, out_SB.at[i].set(next_B)

  carry = (jnp.zeros((), jnp.int32), params, cache, last_B, id_B, done_B,
           jnp.zeros((steps, B), jnp.int32))
  taken, _, cache, last_B, id_B, done_B, out_SB = jax.lax.while_loop(cond, body, carry)
  return cache, last_B, id_B, done_B, out_SB, taken


def generate_batch(model: nnx.Module, prompts_ids, *, num_tokens: int, eos_id: int,
                   temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0, seed: int = 0,
                   vocab_size: int | None = None, document_mask: bool = False,
                   stop_ids=None, prefill_chunk: int | None = None,
                   until: Callable[[int, np.ndarray], bool] | None = None,
                   steps_per_call: int = 64, timings: dict | None = None) -> list[np.ndarray]:
  """Up to `num_tokens` new token ids for each prompt of `prompts_ids` (a list of 1-D id lists, any
  lengths; each a document's start), decoded together (module docstring).

  Each row's ids end at its first stop, which is its last id: a token of `stop_ids` (None: the
  end-of-document token `eos_id`; () or []: never), the `num_tokens`-th id, or the id after which
  `until(row, new_ids) -> bool` first holds (the text-level stop strings: the token that completed
  the string). `until` is asked on the host after the prefill and after every call of up to
  `steps_per_call` decoding steps, with the row's ids so far; when it holds, the row stops and the
  fewest of the ids drawn in that call for which it holds are kept (a row may stop inside a call:
  the ids it drew after that are dropped). The text-level wrappers keep neither the
  end-of-document token nor a stop string in their text. With `vocab_size` (the tokenizer's) no
  id at or past it is ever drawn, even from a model whose vocabulary is larger. `document_mask`:
  the model was trained within documents (`data.document_mask`): an end-of-document token, in a
  prompt or drawn, opens a new one.
  Sampling: row b draws its n-th token with the key (seed, b, n); temperature 0 is greedy.
  `timings` (a dict, for benchmarks) gets the seconds of the prefill (`prefill_s`) and of the
  decoding calls (`decode_s`, host checks excluded) and the decoding steps taken (`steps`).
  A call longer than `progress.EVERY_SECONDS` says how far it is (`progress.phase`).
  """
  check_sampling(temperature, top_k, top_p)
  if prefill_chunk is not None and prefill_chunk < 1:
    raise ValueError(f"prefill_chunk={prefill_chunk} must be at least 1 (or None: one pass)")
  if num_tokens < 1:
    raise ValueError(f"num_tokens={num_tokens} must be at least 1")
  if steps_per_call < 1:
    raise ValueError(f"steps_per_call={steps_per_call} must be at least 1")
  contexts = _contexts(model, prompts_ids, num_tokens, eos_id)
  stop_ids = (eos_id,) if stop_ids is None else tuple(int(s) for s in stop_ids)
  B = len(contexts)
  lengths = np.asarray([len(c) for c in contexts], np.int32)
  L, M = int(lengths.min()), int(lengths.max())
  context_BM = np.full((B, M), eos_id, np.int32)
  for b, c in enumerate(contexts):
    context_BM[b, :len(c)] = c
  # Document ids as in training (an end-of-document token opens the next); past a row's context
  # its ids come from its samples.
  ids_BM = corpus_lib.document_ids(context_BM, eos_id) if document_mask else None
  settings = (eos_id, stop_ids, float(temperature), int(top_k), float(top_p), vocab_size)
  graphdef, params = nnx.split(model)
  key, count = jax.random.key(seed), jnp.asarray(num_tokens, jnp.int32)
  lengths_B = jnp.asarray(lengths)
  limit = M + num_tokens - 1  # the last position whose input is needed, plus one
  spent = {"prefill_s": 0.0, "decode_s": 0.0, "steps": 0}
  status = lambda: (f"decoding step {spent['steps']:,} of at most {limit - L:,}"
                    if spent["prefill_s"] else "prefilling (compiling first)")
  with progress.phase(f"generating {B} row(s) of up to {num_tokens:,} tokens", status=status):
    clock = time.perf_counter()
    cache, last_B, done_B = _prefill_rows(
        params, jnp.asarray(context_BM[:, :L]),
        None if ids_BM is None else jnp.asarray(ids_BM[:, :L]),
        lengths_B, key, count, graphdef=graphdef, max_len=M + num_tokens,
        prefill_chunk=prefill_chunk, settings=settings)
    id_B = None if ids_BM is None else jnp.asarray(ids_BM[:, L - 1])
    samples = [np.asarray(last_B)[:, None]]  # samples[.][b, j]: row b's token at position L + j
    spent["prefill_s"] = time.perf_counter() - clock
    rows = _Rows(lengths - L, num_tokens, stop_ids, until)
    done = rows.ask(samples, np.asarray(done_B))
    steps = max(1, min(steps_per_call, limit - L))
    position = L
    context = jnp.asarray(context_BM)
    while position < limit and not done.all():
      clock = time.perf_counter()
      cache, last_B, id_B, done_B, out_SB, taken = _decode_rows(
          params, cache, last_B, id_B, jnp.asarray(done), context, lengths_B, position, limit, key,
          count, graphdef=graphdef, steps=steps, settings=settings)
      taken = int(taken)
      samples.append(np.asarray(out_SB)[:taken].T)
      done_B = np.asarray(done_B)
      spent["decode_s"] += time.perf_counter() - clock
      spent["steps"] += taken
      position += taken
      done = rows.ask(samples, done_B)
  if timings is not None:
    timings.update(spent)
  return rows.ids(samples)


class _Rows:
  """Each row's new ids from the samples so far, and where `until` stopped it (host side)."""

  def __init__(self, offsets: np.ndarray, num_tokens: int, stop_ids: tuple, until):
    self.offsets, self.num_tokens, self.stop_ids, self.until = offsets, num_tokens, stop_ids, until
    self.cut = np.full(len(offsets), -1)     # the ids `until` kept (-1: it has not held)
    self.asked = np.zeros(len(offsets), int)  # the ids `until` last said no to

  def _row(self, sampled: np.ndarray, b: int) -> np.ndarray:
    return _new_ids(sampled[b], int(self.offsets[b]), self.num_tokens, self.stop_ids)

  def ask(self, samples: list, done_B: np.ndarray) -> np.ndarray:
    """`done_B` (rows the device ended) and the rows `until` ends now: asked once for each row
    it has not ended that has new ids (a row the device ended included: its last ids may hold the
    stop string); where it holds, the fewest ids since its last no for which it holds."""
    if self.until is None:
      return done_B
    sampled = np.concatenate(samples, axis=1)
    for b in range(len(self.cut)):
      if self.cut[b] >= 0:
        continue
      ids = self._row(sampled, b)
      if len(ids) > self.asked[b] and self.until(b, ids):
        self.cut[b] = next((n for n in range(self.asked[b] + 1, len(ids))
                            if self.until(b, ids[:n])), len(ids))
      self.asked[b] = len(ids)
    return done_B | (self.cut >= 0)

  def ids(self, samples: list) -> list[np.ndarray]:
    sampled = np.concatenate(samples, axis=1)
    return [self._row(sampled, b)[:self.cut[b]] if self.cut[b] >= 0 else self._row(sampled, b)
            for b in range(len(self.cut))]


def _new_ids(samples: np.ndarray, offset: int, num_tokens: int, stop_ids: tuple) -> np.ndarray:
  """A row's new ids: its samples from its context's end, up to `num_tokens` and its first stop id
  (kept)."""
  new = samples[offset:offset + num_tokens].astype(np.int32)
  stops = np.flatnonzero(np.isin(new, stop_ids)) if stop_ids else []
  return new[:stops[0] + 1] if len(stops) else new


def generate(model: nnx.Module, prompt_ids, *, num_tokens: int, eos_id: int,
             temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0, seed: int = 0,
             prefill_chunk: int | None = None, vocab_size: int | None = None,
             document_mask: bool = False, stop_ids=()) -> np.ndarray:
  """`num_tokens` new token ids continuing the 1-D `prompt_ids` (a document's start):
  `generate_batch` of one row, which by default never stops early (`stop_ids=()`)."""
  if np.ndim(prompt_ids) != 1:
    raise ValueError(f"prompt_ids has shape {np.shape(prompt_ids)}: generate takes one 1-D prompt; "
                     "give several (of any lengths) to generate_batch as a list")
  return generate_batch(model, [prompt_ids], num_tokens=num_tokens, eos_id=eos_id,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        vocab_size=vocab_size, document_mask=document_mask, stop_ids=stop_ids,
                        prefill_chunk=prefill_chunk)[0]


@dataclasses.dataclass
class Generated:
  """One prompt's continuation: `text` is the prompt and its continuation, `continuation` the new
  text alone (cut before a stop string; never the end-of-document token), `tokens` the new ids (up
  to the stop: the end-of-document token, or the token that completed a stop string), `seconds`
  the time from the call's start (compilation included) until the host saw the row done: the
  host check that found its stop string, else the call's end (rows ending at their count or
  end-of-document token end on the device, untimed)."""
  prompt: str
  text: str
  tokens: list[int]
  seconds: float
  continuation: str = ""


def generate_texts(model: nnx.Module, tokenizer, prompts: list[str], *, num_tokens: int,
                   document_mask: bool, seed: int = 0, temperature: float = 0.8, top_k: int = 40,
                   top_p: float = 1.0, prefill_chunk: int | None = None, stop=(),
                   steps_per_call: int = 64) -> list[Generated]:
  """Every prompt continued in one batched call (`generate_batch`): a row stops at the
  end-of-document token (kept in `tokens`, not in the text), after `num_tokens`, or once its new
  text contains a string of `stop` (`generate_batch`'s `until`: `tokens` end with the token that
  completed it; the text is cut before it). `document_mask`: the workdir's
  `data.document_mask`. The one stop-string mechanism: `efficient_lm.load(...).generate` is this."""
  stop = [s for s in stop if s]
  prompts_ids = [[int(t) for t in tokenizer.encode(p)] for p in prompts]
  heads = [tokenizer.decode(ids) for ids in prompts_ids]
  start = time.perf_counter()
  finished = [None] * len(prompts)

  def new_text(row: int, ids) -> str:  # decoded with the prompt, as a word's leading space needs
    whole = tokenizer.decode(prompts_ids[row] + [int(t) for t in ids if t != tokenizer.eos_id])
    return whole[len(heads[row]):] if whole.startswith(heads[row]) else tokenizer.decode(
        [int(t) for t in ids if t != tokenizer.eos_id])

  def until(row: int, new_ids: np.ndarray) -> bool:
    if any(s in new_text(row, new_ids) for s in stop):
      if finished[row] is None:
        finished[row] = time.perf_counter() - start
      return True
    return False

  new_ids = generate_batch(model, prompts_ids, num_tokens=num_tokens, eos_id=tokenizer.eos_id,
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                           vocab_size=tokenizer.vocab_size, document_mask=document_mask,
                           prefill_chunk=prefill_chunk, until=until if stop else None,
                           steps_per_call=steps_per_call)
  end = time.perf_counter() - start
  out = []
  for row, ids in enumerate(new_ids):
    text = new_text(row, ids)
    cuts = [text.find(s) for s in stop if s in text]
    text = text[:min(cuts)] if cuts else text
    out.append(Generated(prompt=prompts[row], text=heads[row] + text, continuation=text,
                         tokens=[int(t) for t in ids],
                         seconds=end if finished[row] is None else finished[row]))
  return out


def generate_text(model: nnx.Module, tokenizer, prompt: str, *, num_tokens: int, seed: int = 0,
                  temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0,
                  prefill_chunk: int | None = None, document_mask: bool = True, stop=()) -> str:
  """The prompt followed by its sampled continuation, decoded (`generate_texts` of one prompt).
  `document_mask`: the workdir's `data.document_mask` (pass `config.data.document_mask`); the
  default is the config's default, True."""
  return generate_texts(model, tokenizer, [prompt], num_tokens=num_tokens, seed=seed,
                        temperature=temperature, top_k=top_k, top_p=top_p,
                        prefill_chunk=prefill_chunk, document_mask=document_mask, stop=stop)[0].text


def reference_generate(model: nnx.Module, prompt_ids, *, num_tokens: int, seq_len: int,
                       eos_id: int, pad_id: int, temperature: float = 0.8, top_k: int = 40,
                       seed: int = 0, document_mask: bool = False) -> np.ndarray:
  """The uncached decoder: one forward pass over a window of `seq_len` tokens per new token.

  While the context is shorter than the window it is placed at the start and
  padded after (a causal model never sees the padding); a model that returns
  logits only for its last positions (Perceiver-AR) gets it right-aligned after
  end-of-document tokens instead.
  """
  graphdef, params = nnx.split(model)
  num_logits = jax.eval_shape(lambda p, x: nnx.merge(graphdef, p)(x), params,
                              jax.ShapeDtypeStruct((1, seq_len), jnp.int32)).shape[1]

  @jax.jit
  def next_token(params, window_T, index, key):
    ids = None
    if document_mask:
      ids = jnp.cumsum(window_T[None] == eos_id, axis=1, dtype=jnp.int32)
    logits_1TV = nnx.merge(graphdef, params)(window_T[None], segment_ids_BT=ids)
    return sample_logits(logits_1TV[:, index], key, temperature=temperature, top_k=top_k)[0]

  tokens = [eos_id] + [int(t) for t in prompt_ids]
  key = jax.random.key(seed)
  for i in range(num_tokens):
    context = tokens[-seq_len:]
    if len(context) < seq_len and num_logits == seq_len:  # left-aligned, padding after
      window, index = context + [pad_id] * (seq_len - len(context)), len(context) - 1
    else:  # right-aligned: the last position is the last token
      window, index = [eos_id] * (seq_len - len(context)) + context, num_logits - 1
    window_T = jnp.asarray(window, dtype=jnp.int32)
    tokens.append(int(next_token(params, window_T, index, jax.random.fold_in(key, i))))
  return np.asarray(tokens[-num_tokens:], dtype=np.int32)


def sample_from_state(run: RunConfig, params, tokenizer, prompt: str, *,
                      num_tokens: int, seed: int = 0) -> str | None:
  """A sample from trained `params` (any mesh) with the single-device model of `run`.

  With learned positions the sample stops where the position table ends
  (`model.seq_len` tokens in all, the prompt included); None if no token fits.
  """
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.create(run.model, rngs=nnx.Rngs(0))))
  model = nnx.merge(graphdef, params)
  room = context_room(model, len(tokenizer.encode(prompt)))
  if room < 1:
    return None
  return generate_text(model, tokenizer, prompt, num_tokens=min(num_tokens, room), seed=seed,
                       document_mask=run.data.document_mask)
