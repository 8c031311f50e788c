"""Needle in a haystack (RULER's NIAH tasks) on a trained model: `--task=needle`.

A prompt is one document of `length` tokens: an end-of-document token, a haystack (held-out text
with its documents joined: no end-of-document token inside) with the needle(s) spliced in at token
positions, then the question:

    <eos> ...haystack... The special magic number for quiet-harbor is 4818263. ...haystack...
    What is the special magic number for quiet-harbor? The special magic number for quiet-harbor is

The main needle starts at token round(depth * h) of the h haystack tokens. Two scores per prompt:
greedy exact match (the answer `generation.generate_batch` decodes at temperature 0 starts with the
7 digits, and no more digits) and the rank of the true answer's log-likelihood among `distractors`
random 7-digit answers (1 + the wrong ones scoring above it); beside them, the digits the greedy
answer gets right before its first wrong one (`leading_digits`). Variants (`VARIANTS`):

- single: one needle.
- multikey: the needle and `EXTRA_NEEDLES` distractor needles with other keys, at random depths.
- multivalue: `EXTRA_NEEDLES` + 1 needles of the same key with different values, the first at the
  depth, the others at random depths; any of its values counts (exact match: the answer is one of
  them; rank: the best-scored value against the distractors; chance grows accordingly).
- multiquery: `EXTRA_NEEDLES` + 1 needles of different keys, one after another at the depth; each
  key is asked in its own prompt (the same haystack; the question differs), each scored.
"""

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from efficient_lm.data.needle import NEEDLE, QUESTION  # the training source's sentences
from efficient_lm.inference import generation

VARIANTS = ("single", "multikey", "multivalue", "multiquery")
EXTRA_NEEDLES = 3  # multikey: distractor keys; multivalue: more values; multiquery: more keys
DIGITS = 7

_ADJECTIVES = ("quiet", "amber", "brisk", "hollow", "silver", "tidal", "crimson", "gentle", "lucky",
               "wooden", "frozen", "golden", "rapid", "humble", "distant", "bitter", "velvet",
               "ancient", "narrow", "restless")
_NOUNS = ("harbor", "lantern", "meadow", "falcon", "compass", "orchard", "canyon", "anchor", "willow",
          "beacon", "thistle", "quarry", "saddle", "glacier", "marble", "harvest", "pigeon", "tunnel",
          "violin", "summit")


class NeedleError(ValueError):
  """A needle grid that cannot run as asked; the message names the flag and the fix."""


@dataclasses.dataclass
class Prompt:
  """One prompt: `ids` (its `length` tokens, the end-of-document token first), the values that
  count as its answer, `answer_ids` (the tokens of each of them after the question), where each
  needle starts in `ids` and its tokens, and `haystack` (its haystack tokens)."""
  ids: np.ndarray
  key: str
  answers: list[str]
  answer_ids: list[np.ndarray]
  needle_starts: list[int]
  needle_ids: list[np.ndarray]
  haystack: int
  group: int  # prompts of one haystack (multiquery) share it
  other_values: list[str] = dataclasses.field(default_factory=list)  # in the haystack, not asked


def random_key(rng: np.random.Generator, taken=(), words=None) -> str:
  """A key not in `taken`: two random words (`quiet-harbor`), or one of `words` (the key list of
  the `needle:` training source, `data.needle.KEY_WORDS`, so a model is asked the keys it
  learned on)."""
  while True:
    if words:
      key = words[rng.integers(len(words))]
    else:
      key = f"{_ADJECTIVES[rng.integers(len(_ADJECTIVES))]}-{_NOUNS[rng.integers(len(_NOUNS))]}"
    if key not in taken:
      return key


def random_value(rng: np.random.Generator, taken=()) -> str:
  while True:
    value = str(int(rng.integers(10 ** (DIGITS - 1), 10 ** DIGITS)))
    if value not in taken:
      return value


def answer_ids(tokenizer, question_ids: np.ndarray, question: str, value: str) -> np.ndarray:
  """The tokens of ` value` as they follow the question (the question and answer encoded together,
  the question's tokens removed; the value alone where the two do not split there)."""
  whole = np.asarray(tokenizer.encode(f"{question} {value}"), np.int32)
  n = len(question_ids)
  if len(whole) > n and np.array_equal(whole[:n], question_ids):
    return whole[n:]
  return np.asarray(tokenizer.encode(value), np.int32)


def haystack_stream(tokens, eos_id: int) -> np.ndarray:
  """A held-out token stream with its end-of-document tokens removed: one document of text."""
  tokens = np.asarray(tokens)
  return tokens[tokens != eos_id].astype(np.int32)


def build(tokenizer, haystack: np.ndarray, *, length: int, depth: float, variant: str,
          rng: np.random.Generator, group: int = 0, key_words=None) -> list[Prompt]:
  """The prompt(s) of one needle of the grid (several for multiquery), each `length` tokens; keys
  from `key_words` when given (`random_key`)."""
  eos = int(tokenizer.eos_id)
  count = 1 if variant == "single" else EXTRA_NEEDLES + 1
  keys: list[str] = []
  for _ in range(1 if variant == "multivalue" else count):
    keys.append(random_key(rng, keys, key_words))
  values: list[str] = []
  for _ in range(count):
    values.append(random_value(rng, values))
  needle_keys = keys * count if variant == "multivalue" else keys
  texts = [NEEDLE.format(key=k, value=v) for k, v in zip(needle_keys, values)]
  needles = [np.asarray(tokenizer.encode(t), np.int32) for t in texts]
  asked = keys if variant == "multiquery" else keys[:1]
  questions = [QUESTION.format(key=k) for k in asked]
  question_ids = [np.asarray(tokenizer.encode(q), np.int32) for q in questions]
  fixed = 1 + sum(len(n) for n in needles) + max(len(q) for q in question_ids)
  if length - fixed < 1:
    raise NeedleError(f"--lengths: {length} tokens cannot hold the {variant} needles and the "
                      f"question ({fixed} tokens with the end-of-document token); give lengths of "
                      f"at least {fixed + 1}")
  h = length - fixed  # the haystack tokens of the prompt with the longest question
  need = h + max(len(q) for q in question_ids)  # the most haystack any of its prompts holds
  if len(haystack) < need:
    haystack = np.tile(haystack, -(-need // max(1, len(haystack))))  # repeated, as RULER does
  start = int(rng.integers(0, len(haystack) - need + 1))
  main = int(round(depth * h))
  if variant == "multiquery":  # the needles one after another at the depth, in random order
    order = list(rng.permutation(count))
    at = {i: main for i in order}
  else:
    order = [0] + list(range(1, count))
    at = {0: main, **{i: int(rng.integers(0, h + 1)) for i in range(1, count)}}
  order = sorted(order, key=lambda i: (at[i], 0 if i == 0 and variant != "multiquery" else 1))
  prompts = []
  for qi, (key, q_text, q_ids) in enumerate(zip(asked, questions, question_ids)):
    # Every prompt is `length` tokens: a shorter question leaves room for more haystack at the end.
    extra = max(len(q) for q in question_ids) - len(q_ids)
    pieces, starts, cursor, done = [np.asarray([eos], np.int32)], {}, 1, 0
    for i in order:
      pieces.append(haystack[start + done:start + at[i]])
      cursor += at[i] - done
      done = at[i]
      starts[i] = cursor
      pieces.append(needles[i])
      cursor += len(needles[i])
    pieces.append(haystack[start + done:start + h + extra])
    pieces.append(q_ids)
    ids = np.concatenate(pieces).astype(np.int32)
    assert len(ids) == length, (len(ids), length)
    if variant == "multivalue":
      answers = values
    elif variant == "multiquery":
      answers = [values[qi]]
    else:
      answers = values[:1]
    main_needle = qi if variant == "multiquery" else 0
    others = [] if variant == "multivalue" else [v for i, v in enumerate(values) if i != main_needle]
    prompts.append(Prompt(
        ids=ids, key=key, answers=answers,
        answer_ids=[answer_ids(tokenizer, q_ids, q_text, v) for v in answers],
        needle_starts=[starts[main_needle]] + [starts[i] for i in range(count) if i != main_needle],
        needle_ids=[needles[main_needle]] + [needles[i] for i in range(count) if i != main_needle],
        haystack=h + extra, group=group, other_values=others))
  return prompts


def digit_run(text: str) -> str:
  """The answer text's leading run of digits, after spaces ('' if it starts otherwise)."""
  match = re.match(r"\s*(\d+)", text)
  return match.group(1) if match else ""


def is_exact(text: str, answers) -> bool:
  """The answer text starts (after spaces) with one of `answers`' digits, and no more digits."""
  digits = digit_run(text)
  return bool(digits) and digits in answers


def leading_digits(text: str, answers) -> int:
  """How many of the answer's first digits are right, in place: the longest common prefix of the
  answer text's leading run of digits (after spaces) and one of `answers`, the best of them (0 to
  DIGITS). Between exact match (all of them, and no more) and the rank among distractor values,
  it shows how far a greedy answer gets before it goes wrong."""
  return max(len(os.path.commonprefix([digit_run(text), answer])) for answer in answers)


def digits_in_any_order(text: str, answer: str) -> int:
  """How many of the value's digits the answer's first len(answer) digits hold, in any order (the
  multiset overlap: 0 to DIGITS; a permutation of the value scores DIGITS). Beside
  `leading_digits` it tells a model that retrieved the value's digits but not their order from one
  that retrieved nothing."""
  digits = digit_run(text)[:len(answer)]
  return sum(min(digits.count(d), answer.count(d)) for d in set(answer))


def _tile_cache(cache, small, big, B: int, R: int):
  """Each row's cache repeated R times (row b -> rows b*R .. b*R + R-1): every leaf's batch axis
  (the one whose size differs between caches of B and B*R rows; B-major when merged with heads)."""
  def one(x, s, b):
    if s.shape == b.shape:
      return x
    axis = next(i for i, (p, q) in enumerate(zip(s.shape, b.shape)) if p != q)
    assert s.shape[axis] * R == b.shape[axis], (s.shape, b.shape)
    per = s.shape[axis] // B
    y = x.reshape(x.shape[:axis] + (B, per) + x.shape[axis + 1:])
    return jnp.repeat(y, R, axis=axis).reshape(b.shape)
  return jax.tree.map(one, cache, small, big)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "eos_id", "document_mask"))
def candidate_loglik(params, context_BL, answers_BRA, mask_BRA, *, graphdef, max_len: int,
                     eos_id: int, document_mask: bool):
  """Log-likelihood `[B, R]` of each of R candidate answers (A tokens, `mask_BRA` 1 on the real
  ones) after each context: the context prefilled once, its cache repeated for the candidates,
  which are read by one `extend` (no [B * R, L] pass)."""
  model = nnx.merge(graphdef, params)
  B, L = context_BL.shape
  R, A = answers_BRA.shape[1:]
  ids_BL = jnp.cumsum(context_BL == eos_id, axis=1).astype(jnp.int32) if document_mask else None
  logits_BV, cache = generation.prefill(model, context_BL, model.init_cache(B, max_len), None, ids_BL)
  logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
  total_BR = jnp.take_along_axis(logp_BV, answers_BRA[:, :, 0], axis=1) * mask_BRA[:, :, 0]
  if A > 1:
    small = jax.eval_shape(lambda: model.init_cache(B, max_len))
    big = jax.eval_shape(lambda: model.init_cache(B * R, max_len))
    cache = _tile_cache(cache, small, big, B, R)
    x_NC = answers_BRA.reshape(B * R, A)[:, :-1]
    seg_NC = None
    if ids_BL is not None:
      seg_NC = jnp.broadcast_to(jnp.repeat(ids_BL[:, -1], R)[:, None], x_NC.shape)
    logits_NCV, _ = model.extend(x_NC, cache, L, seg_NC)
    logp_NCV = jax.nn.log_softmax(logits_NCV.astype(jnp.float32), axis=-1)
    next_NC = answers_BRA.reshape(B * R, A)[:, 1:]
    tok_NC = jnp.take_along_axis(logp_NCV, next_NC[..., None], axis=-1)[..., 0]
    total_BR = total_BR + (tok_NC * mask_BRA.reshape(B * R, A)[:, 1:]).sum(-1).reshape(B, R)
  return total_BR


def model_context(model, ids: np.ndarray, eos_id: int) -> np.ndarray:
  """The context the model reads for a prompt (its end-of-document token first): as generation
  places it, left-padded with end-of-document tokens to a fixed `prompt_window` (Perceiver-AR)."""
  window = getattr(model, "prompt_window", None)
  if window:
    ids = np.concatenate([np.full(max(0, window - len(ids)), eos_id, np.int32), ids])[-window:]
  return ids


def rank_scores(model, prompts: list[Prompt], candidates: list[list[str]], candidate_ids,
                width: int, *, eos_id: int, document_mask: bool) -> np.ndarray:
  """Log-likelihoods `[len(prompts), R]` of each prompt's R candidate answers (`candidate_ids`:
  their tokens, at most `width`), in one batch."""
  graphdef, params = nnx.split(model)
  B, R = len(prompts), len(candidates[0])
  context_BL = np.stack([model_context(model, p.ids, eos_id) for p in prompts])
  answers_BRA = np.full((B, R, width), eos_id, np.int32)
  mask_BRA = np.zeros((B, R, width), np.float32)
  for b in range(B):
    for r in range(R):
      a = candidate_ids[b][r]
      answers_BRA[b, r, :len(a)] = a
      mask_BRA[b, r, :len(a)] = 1
  out = candidate_loglik(params, jnp.asarray(context_BL), jnp.asarray(answers_BRA),
                         jnp.asarray(mask_BRA), graphdef=graphdef,
                         max_len=context_BL.shape[1] + width, eos_id=int(eos_id),
                         document_mask=bool(document_mask))
  return np.asarray(out, np.float64)


def rank_of(scores_R: np.ndarray, num_true: int) -> int:
  """1 + the distractors (the last R - num_true candidates) scoring at or above the best true one
  (ties count against it)."""
  best = scores_R[:num_true].max()
  return 1 + int(np.sum(scores_R[num_true:] >= best))


def distractor_values(rng: np.random.Generator, answers, count: int) -> list[str]:
  taken = list(answers)
  for _ in range(count):
    taken.append(random_value(rng, taken))
  return taken[len(answers):]
