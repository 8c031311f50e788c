"""The one owner of a training workdir: what it holds, how a run is checked against it, how it is written.

    config.json       the resolved config of the run (evaluation and sampling read it)
    tokenizer.model   the tokenizer the run trains with: a byte-identical copy of the sentencepiece
                      model (tokenizer.json instead for a Hugging Face `data.tokenizer`)
    data.json         the corpus's identity: dataset, its source's fingerprint (the archive's
                      sha256, a `text:` folder's file-list hash, a TFDS version), the tokenizer's
                      sha256 and vocabulary size; and the `config.data` settings that made them
    checkpoints/      Orbax checkpoints (`checkpoint.py`); metrics.jsonl, tensorboard/ (`training/metrics.py`)

Nothing in a workdir changes until every check has passed: the checks compare the run with what
the workdir holds (the model, through the checkpoints' metadata; the corpus and tokenizer, through
`data.json`) and raise one line naming what differs and the fix. `check_settings` answers from
the config alone, before any data is prepared; `check_data` and `check_model` again once the corpus
is loaded. Only then does `write` put `config.json`, `tokenizer.model` and `data.json` in place,
each atomically (written beside, then renamed). A refused run leaves every file byte-identical.
"""

import dataclasses
import json
import logging
import os
import shutil
import tempfile

from efficient_lm import families
from efficient_lm.config import run as config_run
from efficient_lm.config.data import DataConfig
from efficient_lm.config.run import RunConfig
from efficient_lm.runtime import files
from efficient_lm.runtime.files import unique_suffix

log = logging.getLogger(__name__)

CONFIG, TOKENIZER, DATA = "config.json", "tokenizer.model", "data.json"
TOKENIZER_JSON = "tokenizer.json"  # the copy of a Hugging Face tokenizer (`data.tokenizer`)
TOKENIZER_FILES = (TOKENIZER, TOKENIZER_JSON)
CHECKPOINTS = "checkpoints"
# The `config.data` fields that decide the corpus and its tokenizer (recorded in data.json).
CORPUS_SETTINGS = ("dataset", "vocab_size", "tokenizer_train_bytes", "text_key", "archive_sha256",
                   "validation_fraction", "test_fraction", "tokenizer", "separator_token")
# With a `data.tokenizer` of one's own these follow it (the config's values do not decide them).
_SET_BY_TOKENIZER = ("vocab_size", "tokenizer_train_bytes")


def corpus_settings(data_config: DataConfig) -> dict:
  """The corpus-deciding fields (`CORPUS_SETTINGS`) of the typed data section."""
  return {key: getattr(data_config, key) for key in CORPUS_SETTINGS}


def _tokenizers():
  """The data wing's tokenizer module (`data.tokenizer`: a run folder's tokenizer file, opened)."""
  # Imported here: the workdir's checks before jax answer without the data package (numpy,
  # sentencepiece), which every command line runs at its start.
  from efficient_lm.data import tokenizer  # pylint: disable=import-outside-toplevel
  return tokenizer


class WorkdirError(RuntimeError):
  """A directory that is not (yet) a training workdir, where one is needed."""


class WorkdirMismatchError(WorkdirError):
  """The workdir holds a run of another model or corpus than the config describes."""


# A workdir's own entries (`check_usable`: a folder holding other things and none of these is not
# a workdir); names starting with these prefixes count too (tokenizer.<sha>.model, temporary files).
OWN_NAMES = (CONFIG, DATA, CHECKPOINTS, "tensorboard", "profile", "eval", "wandb", "wandb_run_id")
OWN_PREFIXES = ("tokenizer.", "metrics.", f"{CONFIG}.", f"{DATA}.", f"{CHECKPOINTS}_")
# A run's log written into its own folder (`... 2>&1 | tee runs/x/log.txt`, the experiments'
# runners): neither a workdir's nor a stranger's, so a folder holding only logs is usable.
LOG_SUFFIXES = (".log", ".log.txt")
LOG_NAMES = ("log.txt", "stdout", "stderr", "nohup.out")
BYTES_PER_PARAMETER = 4 * 3  # float32 parameters and Adam's two moments, in every checkpoint


def checkpoint_bytes_floor(run: RunConfig) -> tuple[int, int]:
  """(parameters, bytes): a floor on one checkpoint of `run`'s model, from the config alone (no
  jax): every layer's three d_model x d_model attention projections (the fewest any model has) and
  its MLP, and 256 vocabulary rows at most (a small corpus's tokenizer can have fewer pieces than
  data.vocab_size), times `BYTES_PER_PARAMETER`."""
  model = run.model
  d = model.d_model
  per_layer = 3 * d * d + 2 * model.mlp_ratio * d * d
  vocab_rows = min(run.data.vocab_size, 256) * (1 if model.tie_embeddings else 2)
  positions = run.data.seq_len if model.position == "learned" else 0
  params = model.num_layers * per_layer + (vocab_rows + positions) * d
  return params, params * BYTES_PER_PARAMETER


def _size(num_bytes: int) -> str:
  for unit, scale in (("TiB", 2**40), ("GiB", 2**30)):
    if num_bytes >= scale:
      return f"{num_bytes / scale:,.2f} {unit}"
  return f"{num_bytes / 2**20:,.1f} MiB"


def check_usable(path: str, run: RunConfig | None = None) -> None:
  """WorkdirError when `path` cannot be a training workdir, from the filesystem alone (run before
  jax, data or compiling; changes nothing): a file (or a file where a folder above it would be), a
  folder nothing can be created in (the permission bits, then a real probe: that answers for root,
  a read-only filesystem, /proc), a folder holding other things and none of a workdir's own
  (`OWN_NAMES`, `OWN_PREFIXES`; hidden entries and lost+found aside), or, with `run`, a disk
  without room for one checkpoint (`checkpoint_bytes_floor`)."""
  shown = path
  path = os.path.abspath(os.path.expanduser(path))
  fix = "give a new or empty folder, or a workdir a run wrote"
  folder = path
  while not os.path.isdir(folder):  # the workdir, or the nearest folder above it that exists
    if os.path.exists(folder):
      where = "is a file" if folder == path else f"cannot be made: {folder} is a file"
      raise WorkdirError(f"--workdir={shown} {where}, not a folder; {fix}")
    folder = os.path.dirname(folder)
  made = "" if folder == path else f", where {path} would be made"
  if not os.access(folder, os.W_OK | os.X_OK):
    raise WorkdirError(f"--workdir={shown}: {folder} is not writable by this user{made}; give a "
                       "folder you can write in, or change its permissions")
  try:
    os.rmdir(tempfile.mkdtemp(prefix=".efficient_lm-probe-", dir=folder))
  except OSError as e:
    raise WorkdirError(f"--workdir={shown}: nothing can be created in {folder} "
                       f"({e.strerror or e}){made}; give a folder you can write in") from None
  if folder == path:
    entries = sorted(name for name in os.listdir(path)
                     if not name.startswith(".") and name != "lost+found"
                     and name not in LOG_NAMES and not name.endswith(LOG_SUFFIXES))
    if entries and not any(name in OWN_NAMES or name.startswith(OWN_PREFIXES) for name in entries):
      listed = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
      raise WorkdirError(
          f"--workdir={shown} holds other things ({listed}) and none of a workdir's ({CONFIG}, "
          f"{CHECKPOINTS}/, metrics.jsonl, ...): it is not a workdir; {fix} (e.g. "
          f"--workdir={os.path.join(shown, 'run')})")
  if run is not None:
    params, need = checkpoint_bytes_floor(run)
    free = shutil.disk_usage(folder).free
    if free < need:
      raise WorkdirError(
          f"--workdir={shown}: its disk has {_size(free)} free, one checkpoint of this model needs "
          f"at least {_size(need)} ({params:,} parameters x 4 bytes x 3: the parameters and Adam's "
          "two moments); free some space, give a --workdir on a disk with room, or a smaller "
          "model (model.d_model, model.num_layers)")


def model_meta(run: RunConfig, params) -> dict:
  """What a checkpoint's model is: its name and every parameter's shape."""
  import jax  # pylint: disable=import-outside-toplevel  (the module itself stays light)
  import numpy as np  # pylint: disable=import-outside-toplevel
  shapes = {jax.tree_util.keystr(path): list(np.shape(x))
            for path, x in jax.tree_util.tree_leaves_with_path(params)}
  return {"model_name": run.model.name, "param_shapes": shapes}


def _write_atomic(path: str, *, text: str | None = None, copy_from: str | None = None) -> None:
  """`path` holds `text` (or a copy of `copy_from`) or is untouched: written beside, then renamed."""
  tmp = f"{path}.{unique_suffix()}.tmp"
  try:
    if copy_from is not None:
      shutil.copyfile(copy_from, tmp)
    else:
      with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


@dataclasses.dataclass(frozen=True)
class Workdir:
  path: str

  def __post_init__(self):
    object.__setattr__(self, "path", os.path.abspath(os.path.expanduser(self.path)))

  def file(self, name: str) -> str:
    return os.path.join(self.path, name)

  @property
  def checkpoints(self) -> str:
    return self.file(CHECKPOINTS)

  def has_checkpoints(self) -> bool:
    folder = self.checkpoints
    return os.path.isdir(folder) and any(name.isdigit() for name in os.listdir(folder))

  # Reading.

  def saved_dict(self) -> dict | None:
    """The run's config.json as written (its four sections), a `data.tokenizer` of one's own
    pointing at the workdir's copy (the file the run named may have moved: evaluation, sampling
    and a resumed run read the copy); None without config.json. Light: no section is typed."""
    if not os.path.isfile(self.file(CONFIG)):
      return None
    with open(self.file(CONFIG), encoding="utf-8") as f:
      config = json.load(f)
    data = config.get("data") if isinstance(config, dict) else None
    if isinstance(data, dict) and data.get("tokenizer") and os.path.isfile(self.tokenizer_file()):
      data["tokenizer"] = self.tokenizer_file()
    return config

  def saved_config(self) -> RunConfig | None:
    """The run's config (`saved_dict`) as a RunConfig, with the fields added since it was written
    at their defaults, or at what the run was trained with (`config.run.build(..., saved=True)`;
    every section's checks run); None without config.json."""
    config = self.saved_dict()
    return None if config is None else config_run.build(config, families.CLASSES, saved=True)

  def saved_identity(self) -> dict | None:
    if not os.path.isfile(self.file(DATA)):
      return None
    with open(self.file(DATA), encoding="utf-8") as f:
      return json.load(f)

  def tokenizer_file(self) -> str:
    """The workdir's copy of its run's tokenizer: tokenizer.model or tokenizer.json (if both are
    there, a switch cut short: the one data.json's tokenizer_sha256 names)."""
    return _tokenizers().folder_file(self.path)

  def open_tokenizer(self):
    """The run's tokenizer from the workdir's copy, with the separator its run used
    (`data.separator_token` in config.json): what sampling and evaluation encode with."""
    tok = _tokenizers()
    return tok.open_file(self.tokenizer_file(), tok.run_separator(self.path))

  def require_trained(self) -> None:
    """WorkdirError unless this is a training workdir with a config and a tokenizer (evaluation,
    sampling)."""
    if not os.path.exists(self.file(CONFIG)):
      raise WorkdirError(f"{self.path} has no {CONFIG}: it is not a training workdir (give the "
                         "--workdir a `python -m efficient_lm.main` run wrote)")
    if not os.path.exists(self.tokenizer_file()):
      raise WorkdirError(f"{self.path} has no {TOKENIZER} (nor {TOKENIZER_JSON}): it is not a "
                         "training workdir (give the --workdir a `python -m efficient_lm.main` run "
                         "wrote)")
    if not self.has_checkpoints():
      raise WorkdirError(f"{self.path} has no checkpoints yet: train first, or wait for the first "
                         "save (train.checkpoint_every)")

  # Checking.

  def check_settings(self, data_config: DataConfig, *, allow_new_data: bool = False) -> None:
    """WorkdirMismatchError, from the config alone, when the workdir's checkpoints were trained on
    another corpus or tokenizer: the corpus-deciding fields of the typed data section against those
    data.json recorded (older workdirs: the dataset of config.json). Runs before any data is
    prepared."""
    differs, saved, current = self._settings_differing(data_config)
    if not differs or allow_new_data:
      return  # (allow_new_data: the loaded corpus's check warns)
    identity = self.saved_identity() or {}
    first = differs[0]
    if first == "tokenizer_sha256":
      raise WorkdirMismatchError(
          f"workdir {self.path} was trained on another tokenizer (tokenizer_sha256 "
          f"{identity.get('tokenizer_sha256')!r} in its {DATA}, data.tokenizer="
          f"{data_config.tokenizer!r} has {differs[1]!r}); use a new --workdir, or set "
          "train.allow_new_data=True to train these checkpoints further on the new data (the old "
          "tokenizer is kept beside the new one)")
    what = {"dataset": "dataset", "vocab_size": "tokenizer", "tokenizer_train_bytes": "tokenizer",
            "text_key": "text feature", "archive_sha256": "archive", "tokenizer": "tokenizer",
            "separator_token": "separator token"}.get(first, "split of the files")
    raise WorkdirMismatchError(
        f"workdir {self.path} was trained on another {what} (data.{first}={saved[first]!r} in "
        f"its {DATA if 'settings' in identity else CONFIG}, the config gives {current[first]!r}); "
        "use a new --workdir, or set train.allow_new_data=True to train these checkpoints further "
        "on the new data (the old tokenizer is kept beside the new one)")

  def _settings_differing(self, data_config: DataConfig) -> tuple[list, dict, dict]:
    """(the corpus-deciding fields in which the typed data section differs from what the
    checkpoints were trained on, the tokenizer's first; the recorded settings; the config's). No
    difference where the workdir has no checkpoints or records nothing to compare."""
    if not self.has_checkpoints():
      return [], {}, {}
    identity = self.saved_identity() or {}
    saved = identity.get("settings")
    if saved is None:
      config = self.saved_dict()
      if config is None:
        return [], {}, {}
      saved = {"dataset": config["data"]["dataset"]}
    current = corpus_settings(data_config)
    saved = dict(saved, tokenizer=saved.get("tokenizer", ""))  # (written before the field: '')
    differs = []
    if current.get("tokenizer"):
      for key in _SET_BY_TOKENIZER:  # the file decides them
        current.pop(key, None)
      if saved["tokenizer"]:  # its content is what is compared, wherever it lies now
        current["tokenizer"] = saved["tokenizer"]
        differs = self._other_tokenizer_file(identity, data_config)
    if "tokenizer" in current and current["tokenizer"] != saved["tokenizer"]:
      differs.append("tokenizer")  # one's own tokenizer against a trained one: named first
    differs += [k for k in CORPUS_SETTINGS if k in saved and k in current and saved[k] != current[k]]
    return differs, saved, current

  def resume_tokenizer(self, data_config: DataConfig) -> str:
    """The tokenizer file a run of the typed data section tokenizes with when it resumes this
    workdir: the workdir's own copy, where it has checkpoints trained on the corpus and tokenizer
    the config asks for (`check_settings` finds no difference) and the copy is the file data.json
    records (its sha256); '' otherwise (a new run, or new data under train.allow_new_data: the
    config's tokenizer). The workdir is the source of truth: it resumes under any data.data_dir,
    on any machine, whatever tokenizer a cache there holds (the token streams, keyed by the
    file's sha256, are made where missing)."""
    path = self.tokenizer_file()
    if (not self.has_checkpoints() or not os.path.isfile(path)
        or self._settings_differing(data_config)[0]):
      return ""
    recorded = (self.saved_identity() or {}).get("tokenizer_sha256")
    return path if recorded is None or files.sha256_of(path) == recorded else ""

  @staticmethod
  def _other_tokenizer_file(identity: dict, data_config: DataConfig) -> list:
    """['tokenizer_sha256', its sha256] when `data.tokenizer`'s file is not the one data.json
    records, else [] (also when it cannot be read: the config's own check answers that)."""
    try:
      sha = files.sha256_of(os.path.expanduser(data_config.tokenizer))
    except OSError:
      return []
    saved = identity.get("tokenizer_sha256")
    return ["tokenizer_sha256", sha] if saved and sha != saved else []

  def resumed_vocab_size(self, vocab_size: int) -> int:
    """The model's vocabulary when this config resumes the workdir's checkpoints on their corpus:
    the tokenizer's size the workdir recorded, if below `vocab_size` (a small corpus)."""
    saved = self.saved_dict() if self.has_checkpoints() else None
    if saved is None:
      return vocab_size
    return min(vocab_size, int(saved["data"]["vocab_size"]))

  def check_data(self, identity: dict, *, allow_new_data: bool = False) -> None:
    """WorkdirMismatchError when the workdir's checkpoints were trained on another corpus or
    tokenizer than `identity` (a `Corpus.identity`), unless `allow_new_data`."""
    saved = self.saved_identity()
    if saved is None or not self.has_checkpoints():
      return
    differs = [key for key in ("dataset", "source", "tokenizer_sha256", "vocab_size")
               if saved.get(key) != identity.get(key)]
    if not differs:
      return
    if allow_new_data:
      log.warning("training further on other data (%s differs from the checkpoints' run: %s); "
                  "train.allow_new_data=True", ", ".join(differs),
                  ", ".join(f"{k} {saved.get(k)!r} -> {identity.get(k)!r}" for k in differs))
      return
    first = differs[0]
    what = {"dataset": "dataset", "source": "corpus files", "tokenizer_sha256": "tokenizer",
            "vocab_size": "vocabulary size"}[first]
    raise WorkdirMismatchError(
        f"workdir {self.path} was trained on another {what} ({first}: {saved.get(first)!r} in its "
        f"{DATA}, the config gives {identity.get(first)!r}); use a new --workdir, or set "
        "train.allow_new_data=True to train these checkpoints further on the new data (the old "
        "tokenizer is kept beside the new one)")

  def check_before_start(self, run: RunConfig) -> None:
    """WorkdirMismatchError for what config.json and data.json alone can answer (another model
    name, another corpus or tokenizer): run before jax starts. The parameter shapes are checked
    once the model's are known (`check_model`), the corpus once it is loaded (`check_data`)."""
    if not self.has_checkpoints():
      return
    saved = self.saved_dict()
    name = saved["model"]["name"] if saved is not None else None
    if saved is not None and name != run.model.name:
      self.check_model({"model_name": name}, {"model_name": run.model.name})
    self.check_settings(run.data, allow_new_data=run.train.allow_new_data)

  def check_model(self, saved_meta: dict, current_meta: dict) -> None:
    """WorkdirMismatchError when a checkpoint's model (`model_meta`) is not the config's."""
    saved = {k: saved_meta.get(k) for k in current_meta}
    if saved == current_meta:
      return
    if saved.get("model_name") != current_meta["model_name"]:
      what = (f"model.name={saved.get('model_name')!r}, the config has "
              f"{current_meta['model_name']!r}")
    else:
      saved_shapes = saved.get("param_shapes") or {}
      diff = sorted(k for k in set(saved_shapes) | set(current_meta["param_shapes"])
                    if saved_shapes.get(k) != current_meta["param_shapes"].get(k))
      what = (f"parameter shapes differ at {diff[0]}: saved {saved_shapes.get(diff[0])}, "
              f"config gives {current_meta['param_shapes'].get(diff[0])}")
    raise WorkdirMismatchError(
        f"workdir {self.path} holds checkpoints of another model ({what}); use a new --workdir, "
        f"or the config the workdir was trained with (its {CONFIG})")

  # Writing (after every check).

  def write(self, run: RunConfig, tokenizer, identity: dict,
            settings: dict | None = None) -> None:
    """Puts config.json, the tokenizer's byte-identical copy (tokenizer.model: a sentencepiece
    model, or a generated task's description; tokenizer.json: a Hugging Face tokenizer) and
    data.json (`identity`, with `settings`: the run's `corpus_settings`) in place, atomically
    each. A tokenizer that replaces a different one (train.allow_new_data) keeps the old file as
    tokenizer.<its sha256 prefix>.model (or .json)."""
    os.makedirs(self.path, exist_ok=True)
    _write_atomic(self.file(CONFIG), text=run.to_json())
    target = self.file(getattr(tokenizer, "file_name", TOKENIZER))
    source = tokenizer.model_path
    if source is None:  # a generated source's tokenizer saves itself
      source = f"{target}.{unique_suffix()}.new"
      tokenizer.save(source)
    try:
      previous = self.tokenizer_file()
      if os.path.isfile(previous) and files.sha256_of(previous) != files.sha256_of(source):
        stem, ext = os.path.splitext(os.path.basename(previous))
        old = self.file(f"{stem}.{files.sha256_of(previous)[:12]}{ext}")
        shutil.copyfile(previous, old)
        log.warning("kept the workdir's previous tokenizer as %s", old)
      if os.path.abspath(source) != target:
        _write_atomic(target, copy_from=source)
      for name in TOKENIZER_FILES:  # one current copy: the other kind's is kept above
        if self.file(name) != target and os.path.isfile(self.file(name)):
          os.remove(self.file(name))
    finally:
      if tokenizer.model_path is None and os.path.exists(source):
        os.remove(source)
    record = dict(identity, **({"settings": settings} if settings is not None else {}))
    _write_atomic(self.file(DATA), text=json.dumps(record, indent=1, sort_keys=True))


__all__ = ["CONFIG", "CORPUS_SETTINGS", "DATA", "TOKENIZER", "TOKENIZER_FILES", "TOKENIZER_JSON", "Workdir", "WorkdirError",
           "WorkdirMismatchError", "corpus_settings", "model_meta"]
