"""Whether the tokenizer gives back the text it scores: decode(encode(document)) == document for
each document of a split (docs/data.md, "Bits per byte").

Bits per byte divides the NLL of a split's tokens by the UTF-8 bytes of its text. That is the
text's figure only when the tokens hold the text: a tokenizer that lowercases, maps characters to
an unknown token or folds whitespace is scored on a simpler text than the bytes counted, so its
figure compares with nothing. The rule is strict: a split's bits per byte is reported only when
every one of its documents comes back exactly; else it is null with the reason, and the loss per
token and the perplexity stay.

`measure(tokenizer, tokens, documents)` compares each document with what its span of the token
stream decodes to; `Measured` does it once per split and keeps the counts beside the split's token
stream (`tokens/<corpus>-<key>/<split>.round_trip.json`: the stream's key, the corpus's and the
tokenizer's); `withheld(record, split)` is the reason bits per byte is left out, or None.
"""

import json
import logging
import os
from typing import Callable, Iterable

import numpy as np

from efficient_lm.runtime import files
from efficient_lm.data.errors import DataError
from efficient_lm.data.tokenizer_protocol import TokenIds

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what is measured changes
_EXCERPT = 40  # characters of an example shown on each side


def measure(tokenizer: TokenIds, tokens, documents: Iterable[str]) -> dict:
  """{documents, bytes, lost_documents, lost_bytes, example} of the packed stream `tokens` ([eos,
  doc_0, eos, doc_1, ..., eos]) against the texts it was made of: a document is lost when its span
  decodes to anything but its text (`lost_bytes`: the UTF-8 bytes of the lost documents);
  `example`: the first lost document's first difference ({'text', 'decoded'} excerpts) or None."""
  stream = np.asarray(tokens)
  ends = np.flatnonzero(stream == tokenizer.eos_id).tolist()
  counts = dict(documents=0, bytes=0, lost_documents=0, lost_bytes=0, example=None)
  texts = iter(documents)
  for start, end in zip(ends[:-1], ends[1:]):
    text = next(texts, None)
    if text is None:
      raise DataError(f'the token stream holds more documents ({len(ends) - 1}) than its text '
                      f'({counts["documents"]}); delete the tokens/ folder of data.data_dir to '
                      'tokenize it again')
    size = len(text.encode('utf-8'))
    counts['documents'] += 1
    counts['bytes'] += size
    decoded = tokenizer.decode(stream[start + 1:end])
    if decoded != text:
      counts['lost_documents'] += 1
      counts['lost_bytes'] += size
      counts['example'] = counts['example'] or _difference(text, decoded)
  if next(texts, None) is not None:
    raise DataError(f'the token stream holds fewer documents ({len(ends) - 1}) than its text; delete '
                    'the tokens/ folder of data.data_dir to tokenize it again')
  return counts


def _difference(text: str, decoded: str) -> dict:
  """Excerpts of `text` and `decoded` around their first difference."""
  at = next((i for i, (a, b) in enumerate(zip(text, decoded)) if a != b), min(len(text), len(decoded)))
  start = max(0, at - _EXCERPT // 2)
  return {'text': text[start:at + _EXCERPT], 'decoded': decoded[start:at + _EXCERPT]}


def total(records: list[dict]) -> dict:
  """The `measure` counts of several texts together (the first example)."""
  out = {k: sum(r[k] for r in records) for k in ('documents', 'bytes', 'lost_documents', 'lost_bytes')}
  return dict(out, example=next((r['example'] for r in records if r['example']), None))


def withheld(record: dict | None, split: str) -> str | None:
  """Why bits per byte of `split` is left out, given its `measure` record: some documents do not
  come back; None when every one does (or nothing was measured: a corpus made by hand)."""
  if not record or not record['lost_documents']:
    return None
  example = record.get('example')
  return (f"the tokenizer does not give back {record['lost_documents']:,} of the "
          f"{record['documents']:,} {split} documents ({_share(record)} of the bytes"
          + (f"; e.g. {example['text']!r} comes back as {example['decoded']!r}" if example else '')
          + "): bits per byte would not be the text's (docs/data.md, Bits per byte)")


def _share(record: dict) -> str:
  return f"{100 * record['lost_bytes'] / max(record['bytes'], 1):.1f}%"


class Measured:
  """The round trip of each split, measured once (`measure`) and kept in the file `path_of(split)`
  (beside the split's stream); `tokens_of(split)`: its stream, `documents_of(split)`: its texts."""

  def __init__(self, tokenizer: TokenIds, path_of: Callable[[str], str],
               tokens_of: Callable[[str], np.ndarray],
               documents_of: Callable[[str], Iterable[str]]):
    self._tokenizer, self._path_of = tokenizer, path_of
    self._documents_of, self._tokens_of = documents_of, tokens_of
    self._known: dict[str, dict] = {}
    self.measured_now: list[str] = []  # the splits measured by this object (not read back)

  def __call__(self, split: str) -> dict:
    if split not in self._known:
      path = self._path_of(split)
      record = _read(path)
      if record is None:
        record = measure(self._tokenizer, self._tokens_of(split), self._documents_of(split))
        _write(path, dict(record, format=FORMAT))
        self.measured_now.append(split)
      record.pop('format', None)
      self._known[split] = record
    return self._known[split]


def describe(records: dict[str, dict], tokenizer_name: str) -> tuple[int, str]:
  """(log level, the one line) of the round trip of the splits `records` ({split: `measure`})."""
  lost = {s: r for s, r in records.items() if r['lost_documents']}
  if not lost:
    counts = ', '.join(f"{s} {r['documents']:,}" for s, r in records.items())
    return logging.INFO, (f'{tokenizer_name} gives back every held-out document exactly ({counts} '
                          'documents): bits per byte is the text\'s')
  shares = '; '.join(f"{s}: {r['lost_documents']:,} of {r['documents']:,} documents lost "
                     f"({_share(r)} of the bytes)" for s, r in lost.items())
  example = next(r['example'] for r in lost.values())
  return logging.WARNING, (
      f'{tokenizer_name} does not give back the held-out text (decode(encode(text)) != text): '
      f'{shares}; e.g. {example["text"]!r} comes back as {example["decoded"]!r}. Bits per byte '
      f'of {", ".join(lost)} is null (the loss per token and perplexity stay); a tokenizer that '
      'keeps every byte (byte fallback, no normalization) gets it (docs/data.md, Bits per byte)')


def _read(path: str) -> dict | None:
  try:
    with open(path, encoding='utf-8') as f:
      record = json.load(f)
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) and record.get('format') == FORMAT else None


def _write(path: str, record: dict) -> None:
  """`path` holds `record`, or is untouched: written beside, then renamed."""
  tmp = f'{path}.{files.unique_suffix()}.tmp'
  try:
    with open(tmp, 'w', encoding='utf-8') as f:
      json.dump(record, f, indent=1, ensure_ascii=False)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
