"""Reading a tokenizer's JSON file: one line naming the file when it is not valid JSON (a copy cut
short says so), or when it is JSON of another kind than a Hugging Face tokenizer.json. Shared by
`tokenizer` (which sniffs what a file is) and `hf_tokenizer` (which opens one)."""

import json


def read_json(path: str):
  """The JSON value in `path`; a ValueError, one line, naming the file when it is not valid JSON
  (a file cut short, a copy or download that stopped, says so)."""
  with open(path, 'rb') as f:
    raw = f.read()
  try:
    return json.loads(raw.decode('utf-8'))
  except UnicodeDecodeError as e:
    cut = e.reason == 'unexpected end of data'
    detail = f'invalid UTF-8 at byte {e.start:,}'
  except ValueError as e:  # json.JSONDecodeError
    cut = e.pos >= len(e.doc.rstrip()) or e.msg.startswith('Unterminated string')
    detail = f'{e.msg.removesuffix(" at")} at line {e.lineno} column {e.colno}'
  ending = (f'it ends mid-way, after {len(raw):,} bytes: truncated? copy the whole file again'
            if cut else 'give the file the tokenizers library saved (Tokenizer.save)')
  raise ValueError(f'{path} is not valid JSON ({detail}); {ending}') from None


def check_tokenizer_json(path: str, record) -> None:
  """A ValueError, one line, saying what the JSON value `record` (of the file `path`) is and
  which part of a Hugging Face tokenizer.json it lacks: a "model" section with a "vocab"."""
  model = record.get('model') if isinstance(record, dict) else None
  if isinstance(model, dict) and 'vocab' in model:
    return
  if isinstance(model, dict):
    keys = ', '.join(map(repr, list(model)[:6])) or 'none'
    lacks = f'its "model" section has no "vocab" (its keys: {keys})'
  else:
    lacks = 'it has no "model" section (the tokenizer\'s kind and vocabulary)'
  if isinstance(record, dict):
    keys = ', '.join(map(repr, list(record)[:6])) + (', ...' if len(record) > 6 else '')
    what = f'a JSON object with the keys {keys}' if record else 'an empty JSON object'
  else:
    what = f'a JSON {"list" if isinstance(record, list) else "value"}'
  raise ValueError(f'{path} is {what}, not a Hugging Face tokenizer.json: {lacks}; give the '
                   'tokenizer.json the tokenizers library saved (Tokenizer.save)')
