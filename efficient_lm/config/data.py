"""`DataConfig`: the data section, typed: each field's default, meaning and check.

`config_base.base_config` reads the section's defaults from here and `--help` its docs;
`run.build` builds it from a config's data section (`DataConfig.from_mapping`), which runs every
check; `data.validate` then checks what needs the dataset's registry or the disk (a known
`data.dataset`, its options, `data.tokenizer`'s file, `data.archive`). This module imports
neither jax nor the data package.
"""

import dataclasses
import numbers
import re

from efficient_lm.config import fields as tc


def _text(requirement: str, fix: str, *, empty: bool = True) -> tc.Check:
  return tc.Check(lambda v: isinstance(v, str) and (empty or v.strip() != ""), requirement, fix)


def _fraction(default: float) -> tc.Check:
  return tc.Check(
      lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and 0 <= v < 1,
      "must be a number in [0, 1)", f"set {{field}} to e.g. {default} (0 = no such split)")


def _sha256_ok(value) -> bool:
  return isinstance(value, str) and (value == ""
                                     or re.fullmatch(r"[0-9a-fA-F]{64}", value) is not None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig(tc.Section):
  """The data section."""
  SECTION = "data"

  dataset: str = tc.setting(
      "shakespeare", "'shakespeare', 'wikitext103', 'python_code', 'tfds:<name>', 'text:<glob>', "
      "'hf:<path>[:<config_name>]' (what datasets.load_dataset loads), 'mqar:<options>' or "
      "'needle:<options>' (data/registry.py)",
      _text("must be a string", "set data.dataset, e.g. 'shakespeare'"))  # known: data.validate
  seq_len: int = tc.setting(256, "tokens per training window (the model's context)",
                            tc.positive_int())
  batch_size: int = tc.setting(8, "windows per step", tc.positive_int())
  vocab_size: int = tc.setting(8192, "sentencepiece vocabulary size (trained on the train split); "
                               "with data.tokenizer: that tokenizer's size, whatever is set",
                               tc.positive_int())
  data_dir: str = tc.setting("~/.cache/efficient_lm", "prepared ArrayRecord files, tokenizer and "
                             "token cache", _text("must be a directory path",
                                                  "set data.data_dir, e.g. ~/.cache/efficient_lm",
                                                  empty=False))
  archive: str = tc.setting("", "local copy of the dataset archive; '' = download it",
                            _text("must be a string",
                                  "set data.archive to '' (download) or a local archive path"))
  archive_sha256: str = tc.setting("", "expected sha256 of the archive; '' = the official one",
                                   tc.Check(_sha256_ok, "must be 64 hex digits or empty",
                                            "set data.archive_sha256 to '' (the official archive) "
                                            "or the archive's sha256"))
  text_key: str = tc.setting("text", "text feature of a 'tfds:<name>' dataset, text column of an "
                             "'hf:' one", _text("must name the text feature",
                                                "set data.text_key, e.g. 'text'", empty=False))
  document_mask: bool = tc.setting(
      True, "batches carry document ids: no position attends across an end-of-document token "
      "into another document (generated tasks such as mqar: one document a sequence, no ids)",
      tc.boolean("set data.document_mask=True (documents never attend into each other) or False"))
  tokenizer_train_bytes: int = tc.setting(
      20_000_000, "the tokenizer trains on at most this much text: the same share of every train "
      "document (0 = all of it); above the embedded corpus (4.5 MB) training takes ~1 s per MB "
      "less, and rare strings split into more pieces (bits per byte barely move)",
      tc.Check(lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0,
               "must be an integer >= 0", "set it to 0 (all the train split) or a byte budget"))
  tokenizer: str = tc.setting(
      "", "a tokenizer of one's own, used as it is (never retrained): a sentencepiece .model or a "
      "Hugging Face tokenizer.json; it sets data.vocab_size. '' = train one on the train split",
      _text("must be a path or empty", "set data.tokenizer to a sentencepiece .model or a "
            "tokenizer.json, or '' to train one"))
  separator_token: str = tc.setting(
      "", "data.tokenizer's token that ends each document ('' = its eos / end-of-text token, "
      "e.g. <|endoftext|>, </s>, [SEP])",
      _text("must be a string", "set data.separator_token to one of the tokenizer's special "
            "tokens, or '' for its eos"))
  validation_fraction: float = tc.setting(0.05, "'text:<glob>': share of the files (or bytes) "
                                          "held out for validation", _fraction(0.05))
  test_fraction: float = tc.setting(0.05, "'text:<glob>': share held out for test; 0 = no such "
                                    "split (an 'hf:' dataset without such a split: share of "
                                    "train's rows)", _fraction(0.05))
  hf_allow_download: bool = tc.setting(
      False, "'hf:<name>' may download from the hub (else offline: the cache only)",
      tc.boolean("set data.hf_allow_download=False (the local datasets cache only) or True"))

  RULES = (
      tc.Rule("data.separator_token", lambda c: c.tokenizer or c.separator_token == "",
              "only applies to a data.tokenizer of one's own",
              "set data.separator_token to '' (the trained tokenizer's eos separates documents)"),
      tc.Rule("data.validation_fraction", lambda c: c.validation_fraction + c.test_fraction < 1,
              "plus data.test_fraction={test_fraction!r} must be below 1 (train keeps the rest)",
              "lower data.validation_fraction or data.test_fraction"),
  )


__all__ = ["DataConfig"]
