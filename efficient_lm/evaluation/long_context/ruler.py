"""RULER's synthetic tasks (Hsieh et al., 2024), offline, on the model's own tokenizer:
`--task=ruler` (docs/long_context_evals.md, "RULER's synthetic tasks").

The eleven tasks under lm-eval's names (`TASKS`), each as RULER defines it (`SPECS`: the haystack,
the kinds of keys and values, how many needles, keys, values and queries, the new tokens allowed):

- NIAH (`niah_*`): needles 'One of the special magic numbers for <key> is: <value>.' in a
  haystack, the question asks one key (single, multikey), all values of one key (multivalue) or
  four keys at once (multiquery); the haystack is RULER's noise sentence repeated (`repeat`),
  held-out text (`essay`, RULER's Paul Graham essays) or distractor needles of other keys
  (`needle`). Keys are adjective-noun words or UUIDs, values 7-digit numbers or UUIDs.
- `ruler_vt`: variable tracking, one chain of 4 hops ('VAR ABCDE = 12345', 'VAR FGHIJ = VAR
  ABCDE', ...) in the noise; the answer is every variable of the chain.
- `ruler_cwe`: a numbered list of words, 10 of them repeated more often; the answer is those 10.
- `ruler_fwe`: coded words drawn from a Zipf law (alpha 2) with the top rank the noise '...'; the
  answer is the three most frequent coded words.

Every prompt is text fitted to its length in the model's tokens (`ruler_fit`): `length` counts
the model's input, the end-of-document token and the prompt, whose last words are the answer
prefix (RULER's: 'The special magic number for <key> mentioned in the provided text is'). Every
draw comes from `np.random.default_rng([seed, length, task number, index, attempt])`: a prompt
is drawn again (attempt 1, 2, ...) until one fills its length exactly, so that a length's
prompts share one shape (one compile); else the longest of `ATTEMPTS` draws is kept.
"""

import dataclasses
import math
import re
import uuid

import numpy as np

from efficient_lm.evaluation.long_context import ruler_fit
from efficient_lm.evaluation.long_context import ruler_words
from efficient_lm.evaluation.long_context.ruler_fit import RulerError
from efficient_lm.evaluation.long_context.ruler_tasks import SPECS, TASKS, Spec  # pylint: disable=unused-import

# RULER's noise haystack (niah_single_1, variable tracking), its 40 needle depths, its templates.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = tuple(float(d) / 100 for d in np.round(np.linspace(0, 100, num=40)).astype(int))
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_TAIL = ("\nQuestion: Find all variables that are assigned the value {value} in the text above. "
           "Answer: According to the chain(s) of variable assignment in the text above, {count} "
           "variables are assgined the value {value}, they are:")  # sic: RULER's wording
VT_HOPS, VT_NAME_LETTERS = 4, 5
VT_EXAMPLE_LETTERS, VT_EXAMPLE_NOISE = 3, 5  # the worked example: shorter names, 5 noise repeats
CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than "
            "others. Memorize the ones that appear most often.\n")
CWE_TAIL = ("\nQuestion: What are the 10 most common words in the above list? Answer: The top 10 "
            "words that appear most often in the list are:")
CWE_COMMON = 10
FWE_HEAD = ("Read the following coded text and track the frequency of each coded word. Find the "
            "three most frequently appeared coded words. ")
FWE_TAIL = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are "
            "the three most frequently appeared words in the above coded text? Answer: According "
            "to the coded text above, the three most frequently appeared words are:")
FWE_NOISE, FWE_ALPHA, FWE_LETTERS, FWE_ANSWERS = "...", 2, 6, 3
FWE_ZETA = math.pi ** 2 / 6  # zeta(FWE_ALPHA), the Zipf law's normalizer
ATTEMPTS = 16  # draws of a prompt at most, until one fills its length exactly (else the longest)
EXAMPLE_SHARE = 4  # vt and cwe carry RULER's worked example when it takes at most 1/4 the prompt


@dataclasses.dataclass
class Item:
  """One prompt: its `text` (the answer prefix last), `ids` = tokenizer.encode(text) (the model
  reads [eos] + ids: `len(ids) + 1` tokens, within TOLERANCE of `length`), the strings a right
  answer holds (`outputs`), the new tokens allowed, and what was drawn (`details`)."""
  task: str
  length: int
  index: int
  text: str
  ids: np.ndarray
  outputs: list[str]
  new_tokens: int
  details: dict


def _distinct(draw, count: int, taken=()) -> list[str]:
  out, seen = [], set(taken)
  while len(out) < count:
    value = draw()
    if value not in seen:
      seen.add(value)
      out.append(value)
  return out


def _drawer(rng: np.random.Generator, kind: str):
  """A function drawing one random key or value of `kind` (words, numbers, uuids) as RULER does."""
  if kind == "numbers":
    return lambda: str(int(rng.integers(10 ** 6, 10 ** 7)))
  if kind == "uuids":
    return lambda: str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4))
  adjectives, nouns = ruler_words.ADJECTIVES, ruler_words.NOUNS
  return lambda: f"{adjectives[rng.integers(len(adjectives))]}-{nouns[rng.integers(len(nouns))]}"


def _depths(rng: np.random.Generator, count: int) -> list[float]:
  """`count` of RULER's 40 depths, distinct, in random order."""
  return [DEPTHS[i] for i in rng.choice(len(DEPTHS), size=count, replace=False)]


def _essay_units(tokenizer, haystack: np.ndarray, rng, need: int) -> list[str]:
  """Sentences (each with its trailing whitespace) of held-out text from a random offset, at least
  `need` tokens of them: the text decoded from the token stream, the first (cut) sentence
  dropped; the stream repeated when it is shorter, as RULER repeats its essays."""
  window = need * 2 + 256
  if len(haystack) < window:
    haystack = np.tile(haystack, -(-window // max(1, len(haystack))))
  start = int(rng.integers(0, len(haystack) - window + 1))
  text = tokenizer.decode(haystack[start:start + window])
  units = re.findall(r"\S.*?(?:[.!?][\"')\]]*\s+|\n\s*|$)", text, flags=re.S)
  return [u for u in units[1:] if u.strip()]


def _niah(tokenizer, spec: Spec, target: int, rng, haystack, what: str):
  keys = _distinct(_drawer(rng, spec.keys), max(spec.num_keys, spec.num_queries))
  flat = _distinct(_drawer(rng, spec.values), len(keys) * spec.num_values)  # all distinct
  values = [flat[i * spec.num_values:(i + 1) * spec.num_values] for i in range(len(keys))]
  needles = [NEEDLE.format(kind=spec.values, key=k, value=v) for k, vs in zip(keys, values)
             for v in vs]
  needles = [needles[i] for i in rng.permutation(len(needles))]
  asked = [int(i) for i in rng.choice(len(keys), size=spec.num_queries, replace=False)]
  query = (", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]]
           if len(asked) > 1 else keys[asked[0]])
  plural = spec.num_queries * spec.num_values > 1
  kind = spec.values if plural else spec.values[:-1]
  verb = "are" if plural else "is"
  head = (f"{'Some' if plural else 'A'} special magic {kind} {verb} hidden within the following "
          f"text. Make sure to memorize it. I will quiz you about the {kind} afterwards.\n")
  tail = (f"\nWhat {'are all' if plural else 'is'} the special magic {kind} for {query} mentioned "
          f"in the provided text? The special magic {kind} for {query} mentioned in the provided "
          f"text {verb}")
  if spec.haystack == "essay":
    units, sep = _essay_units(tokenizer, haystack, rng, target), ""
  elif spec.haystack == "repeat":
    units, sep = [NOISE] * (target // 4 + 2), "\n"
  else:  # distractor needles: other keys, other values
    count = target // 6 + 8
    units = [NEEDLE.format(kind=spec.values, key=k, value=v) for k, v in zip(
        _distinct(_drawer(rng, spec.keys), count, keys),
        _distinct(_drawer(rng, spec.values), count, flat))]
    sep = "\n"
  filler = ruler_fit.Filler(tokenizer, units)
  depths = _depths(rng, len(needles))
  inserts = list(zip(depths, needles))

  def render(h: int) -> str:
    n, partial = filler.take(h)
    return head + ruler_fit.weave(filler.units[:n], partial, inserts, sep) + tail

  h, text, ids = ruler_fit.fit(render, tokenizer.encode, target, filler.tokens, what)
  outputs = [v for i in asked for v in values[i]]
  return text, ids, outputs, {"keys": keys, "asked": [keys[i] for i in asked],
                              "depths": depths, "haystack_tokens": h}


def _vt_chain(rng, letters: int) -> tuple[list[str], str, list[str]]:
  """(the chain's variables, its value, its statements in order): VT_HOPS + 1 distinct names of
  `letters` capital letters, the first assigned a 5-digit number, each next the one before."""
  name = lambda: "".join(chr(65 + int(c)) for c in rng.integers(0, 26, size=letters))
  names = _distinct(name, VT_HOPS + 1)
  value = str(int(rng.integers(10000, 100000)))
  statements = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}"
                                                for j in range(VT_HOPS)]
  return names, value, statements


def _vt(tokenizer, spec: Spec, target: int, rng, haystack, what: str):
  del spec, haystack

  def prompt(names, value, statements, units, partial, depths):
    context = ruler_fit.weave(units, partial, list(zip(depths, statements)), "\n")
    return VT_HEAD + context + VT_TAIL.format(value=value, count=len(names))

  # RULER's worked example (3-letter names, its answer after it), when it is short enough.
  ex_names, ex_value, ex_statements = _vt_chain(rng, VT_EXAMPLE_LETTERS)
  example = (prompt(ex_names, ex_value, ex_statements, [NOISE] * VT_EXAMPLE_NOISE, "",
                    sorted(_depths(rng, VT_HOPS + 1))) + " " + " ".join(ex_names) + "\n\n")
  if len(tokenizer.encode(example)) > target // EXAMPLE_SHARE:
    example = ""
  names, value, statements = _vt_chain(rng, VT_NAME_LETTERS)
  depths = sorted(_depths(rng, VT_HOPS + 1))  # the chain in order
  filler = ruler_fit.Filler(tokenizer, [NOISE] * (target // 4 + 2))

  def render(h: int) -> str:
    n, partial = filler.take(h)
    return example + prompt(names, value, statements, filler.units[:n], partial, depths)

  h, text, ids = ruler_fit.fit(render, tokenizer.encode, target, filler.tokens, what)
  return text, ids, names, {"value": value, "statements": statements, "depths": depths,
                            "example": bool(example), "haystack_tokens": h}


def _numbered(words) -> str:
  return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe_list(rng_seed, common, uncommon, f_common: int, f_uncommon: int) -> list[str]:
  words = list(common) * f_common + list(uncommon) * f_uncommon
  order = np.random.default_rng(rng_seed).permutation(len(words))
  return [words[i] for i in order]


def _cwe(tokenizer, spec: Spec, target: int, rng, haystack, what: str):
  """RULER's frequencies: 30 and 3 from 4,096 tokens, else 6 and 1; below, where 10 common words
  6 times and 10 others do not fit, the common ones 4, 3 or 2 times (always above the others)."""
  del spec, haystack
  pool = list(ruler_words.ADJECTIVES + ruler_words.NOUNS + ruler_words.VERBS)
  pool = [pool[i] for i in rng.permutation(len(pool))]
  seed = int(rng.integers(2 ** 31))
  long = target >= 4096
  ex_words = pool[-(40 if long else 20):]
  ex_list = _cwe_list(seed + 1, ex_words[:CWE_COMMON], ex_words[CWE_COMMON:], 10 if long else 3,
                      3 if long else 1)
  example = (CWE_HEAD + _numbered(ex_list) + CWE_TAIL + " " + _numbered(ex_words[:CWE_COMMON]) +
             "\n")
  if len(tokenizer.encode(example)) > target // EXAMPLE_SHARE:
    example = ""
  pool = pool[:len(pool) - len(ex_words)]
  common, spare = pool[:CWE_COMMON], pool[CWE_COMMON:]
  f_uncommon = 3 if long else 1

  def render_with(f_common, uncommon):
    return example + CWE_HEAD + _numbered(_cwe_list(seed, common, uncommon, f_common,
                                                    f_uncommon)) + CWE_TAIL

  size = lambda text: len(tokenizer.encode(text))
  for f_common in ((30,) if long else (6, 4, 3, 2)):
    if size(render_with(f_common, spare[:CWE_COMMON])) <= target:
      break  # else the last (fewest repeats): fewer than 10 uncommon words fit
  n, text, ids = ruler_fit.fit(lambda n: render_with(f_common, spare[:n]), tokenizer.encode,
                               target, len(spare), what)
  return text, ids, list(common), {"common_repeats": f_common, "uncommon_repeats": f_uncommon,
                                   "uncommon": n, "example": bool(example)}


def fwe_counts(num_words: int, vocab: int) -> list[int]:
  """Each coded word's count, by rank: RULER's floor(num_words * k^-alpha / zeta(alpha)), every
  rank past the answers' below the last answer (so the answers are the most frequent)."""
  counts = [math.floor(num_words * k ** -FWE_ALPHA / FWE_ZETA) for k in range(1, vocab + 1)]
  last = counts[FWE_ANSWERS]  # rank FWE_ANSWERS + 1: the last answer (rank 1 is the noise)
  return counts[:FWE_ANSWERS + 1] + [min(c, last - 1) for c in counts[FWE_ANSWERS + 1:]]


def _fwe(tokenizer, spec: Spec, target: int, rng, haystack, what: str):
  del spec, haystack
  size = max(FWE_ANSWERS + 2, (target + 1) // 50)  # RULER: a vocabulary of length / 50 words
  coded = lambda: "".join(chr(97 + int(c)) for c in rng.integers(0, 26, size=FWE_LETTERS))
  vocab = [FWE_NOISE] + _distinct(coded, size - 1)
  seed = int(rng.integers(2 ** 31))
  least = math.ceil(FWE_ZETA * (FWE_ANSWERS + 1) ** FWE_ALPHA)  # the last answer drawn once

  def render(num_words: int, dots: int = 0) -> str:
    counts = fwe_counts(least + num_words, len(vocab))
    words = [w for w, c in zip(vocab, counts) for _ in range(max(c, 0))]
    words = [words[i] for i in np.random.default_rng(seed).permutation(len(words))]
    places = np.random.default_rng(seed + 1).integers(0, len(words) + 1, size=dots)
    for place in places:
      words.insert(int(place), FWE_NOISE)
    return FWE_HEAD + " ".join(words) + FWE_TAIL

  n, _, _ = ruler_fit.fit(render, tokenizer.encode, target, target * 2, what)
  dots, text, ids = ruler_fit.fit(lambda d: render(n, d), tokenizer.encode, target, target, what)
  counts = fwe_counts(least + n, len(vocab))
  return text, ids, vocab[1:FWE_ANSWERS + 1], {"words": least + n, "extra_dots": dots,
                                              "counts": dict(zip(vocab, counts))}


_BUILDERS = {"niah": _niah, "vt": _vt, "cwe": _cwe, "fwe": _fwe}


def build(tokenizer, task: str, *, length: int, index: int, seed: int = 0,
          haystack: np.ndarray | None = None) -> Item:
  """Prompt number `index` of `task` at `length` tokens (the model's input, its end-of-document
  token included); `haystack`: the held-out token stream (no end-of-document token) that the
  essay tasks read."""
  if task not in SPECS:
    raise RulerError(f"--ruler_tasks: {task!r} is not a RULER task; use some of {', '.join(TASKS)}")
  spec = SPECS[task]
  if spec.haystack == "essay" and (haystack is None or not len(haystack)):
    raise RulerError(f"{task} draws its haystack from held-out text, and there is none; give "
                     "--haystack=FILE with some text")
  what = f"{task} at {length} tokens"
  best = None
  for attempt in range(ATTEMPTS):  # every prompt the same length: one compiled shape a length
    rng = np.random.default_rng([seed, length, TASKS.index(task), index, attempt])
    drawn = _BUILDERS[spec.kind](tokenizer, spec, length - 1, rng, haystack, what)
    if best is None or len(drawn[1]) > len(best[1]):
      best = drawn
    if len(best[1]) == length - 1 or len(drawn[1]) + 1 < length * (1 - ruler_fit.TOLERANCE):
      break  # exact, or what fills it ran out (as it will again)
  text, ids, outputs, details = best
  ruler_fit.check_length(len(ids) + 1, length, what, {
      "cwe": "its list of words (long_context/ruler_words.py)", "fwe": "its coded words"}.get(
          spec.kind, "its haystack"))
  return Item(task=task, length=length, index=index, text=text, ids=np.asarray(ids, np.int32),
              outputs=[str(o) for o in outputs], new_tokens=spec.new_tokens, details=details)
