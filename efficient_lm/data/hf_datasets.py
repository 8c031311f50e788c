"""`data.dataset='hf:<path>'`: a Hugging Face `datasets` dataset as a TFDS dataset.

    --config.data.dataset=hf:~/corpora/mine               # a folder of json/jsonl/parquet/csv/txt files
    --config.data.dataset=hf:~/corpora/saved              # a folder written by save_to_disk
    --config.data.dataset=hf:wikitext:wikitext-2-raw-v1   # a hub name in the local cache, and its config

`<path>` is what `datasets.load_dataset` takes as its first argument (`load_from_disk` for a
`save_to_disk` folder); `:<config_name>` after it picks the dataset's config. Nothing is downloaded
unless `data.hf_allow_download=True`: the hub is offline while `datasets` runs here. `resolve`
loads it (a folder of data files is converted to Arrow in the `datasets` cache, HF_DATASETS_CACHE),
checks `data.text_key` and the splits, and returns a `Resolved` with its cache key; `make_builder`
gives the `HFDataset` builder, one document per row (feature `data.text_key`), stored in
`<data.data_dir>/tfds/hf/<cache_key>/`. A split missing among validation and test is held out of
train (`held_out_rows`: `data.validation_fraction` / `data.test_fraction` of the rows).
Details: docs/data.md, "Hugging Face datasets".
"""

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re

import numpy as np
import tensorflow_datasets as tfds

from efficient_lm.data import registry
from efficient_lm.data import text_builder
from efficient_lm.data.held_out import HELD_OUT, held_out_counts  # held out when the dataset lacks them
from efficient_lm.data.errors import DataError
from efficient_lm.config.errors import ConfigError

log = logging.getLogger(__name__)

HF_PREFIX = registry.HF_PREFIX
SAVED_MARKERS = ('dataset_dict.json', 'state.json')  # a save_to_disk folder has one of these
_KEY_FORMAT = 1  # bump when what a key covers, or the way rows are read or held out, changes
_READ_ROWS = 1024  # rows per read from the Arrow table


def parse(dataset: str) -> tuple[str, str | None]:
  """(path, config name) of 'hf:<path>' or 'hf:<path>:<config_name>'; `~` expanded, a local path
  made absolute. A path that exists is never split at a ':'."""
  body = dataset[len(HF_PREFIX):].strip()
  path, name = body, None
  if not os.path.exists(os.path.expanduser(body)) and ':' in body:
    head, _, tail = body.rpartition(':')
    if head and tail and '/' not in tail:
      path, name = head, tail
  expanded = os.path.expanduser(path)
  return (os.path.abspath(expanded) if os.path.exists(expanded) else path), name


def _looks_local(path: str) -> bool:
  """Whether `path` can only be a local path (a hub name is 'name' or 'owner/name')."""
  return (path.startswith(('/', '.', '~')) or path.count('/') > 1 or os.sep != '/' and os.sep in path)


@contextlib.contextmanager
def _hub_access(allowed: bool):
  """The hub offline while the block runs (unless `allowed`), and no progress bars."""
  import datasets  # pylint: disable=g-import-not-at-top
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top

  saved = (datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE,
           {k: os.environ.get(k) for k in ('HF_HUB_OFFLINE', 'HF_DATASETS_OFFLINE')})
  bars_were_off = datasets.are_progress_bars_disabled()
  if not allowed:
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    os.environ.update(HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1')
  datasets.disable_progress_bars()
  try:
    yield datasets
  finally:
    datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved[:2]
    for k, v in saved[2].items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    if not bars_were_off:
      datasets.enable_progress_bars()


def _first_line(e: Exception) -> str:
  text = str(e).strip()
  return f'{type(e).__name__}: {text.splitlines()[0][:300]}' if text else type(e).__name__


def load_splits(dataset: str, allowed: bool) -> dict:
  """{split name as `datasets` gives it: datasets.Dataset} of 'hf:...'; one ConfigError line when
  it cannot be loaded (not found, not cached while downloads are off, a bad config name)."""
  path, name = parse(dataset)
  allow = ('set data.hf_allow_download=True to download it once into the datasets cache, or '
           'point hf: at a local folder')
  if os.path.isfile(path):
    raise ConfigError(f'data.dataset={dataset!r} is a file; point hf: at the folder that holds it '
                      '(its files become splits by their names: train, validation, test)')
  if not os.path.isdir(path) and _looks_local(path):
    raise ConfigError(f'data.dataset={dataset!r}: {path} is not a folder (and not a hub name, '
                      "'name' or 'owner/name'); fix the path")
  with _hub_access(allowed) as datasets:
    try:
      if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in SAVED_MARKERS):
        if name is not None:
          raise ConfigError(f'data.dataset={dataset!r}: a save_to_disk folder has no config names; '
                            f"drop ':{name}'")
        loaded = datasets.load_from_disk(path)
      else:
        loaded = datasets.load_dataset(path, name)
    except ConfigError:
      raise
    except (ConnectionError, FileNotFoundError) as e:
      if os.path.isdir(path) or allowed:
        raise ConfigError(f'data.dataset={dataset!r} cannot be loaded ({_first_line(e)}); fix the '
                          'folder, or check the name') from e
      cache = datasets.config.HF_DATASETS_CACHE
      raise ConfigError(f'data.dataset={dataset!r} is not a local folder and not in the datasets '
                        f'cache ({cache}), and downloads are off; {allow}') from e
    except ValueError as e:  # a config name that is missing or unknown, no data files, ...
      raise ConfigError(f'data.dataset={dataset!r} cannot be loaded ({_first_line(e)}); pick the '
                        "config as 'hf:<path>:<config_name>' where it asks for one") from e
    except Exception as e:  # pylint: disable=broad-except  (unreadable files, gated repos, ...)
      raise ConfigError(f'data.dataset={dataset!r} cannot be loaded ({_first_line(e)}); fix the '
                        'data or data.dataset') from e
  if isinstance(loaded, datasets.Dataset):  # one split (a saved Dataset): the train split
    return {'train': loaded}
  if not isinstance(loaded, datasets.DatasetDict):
    raise ConfigError(f'data.dataset={dataset!r} loads as {type(loaded).__name__}, not a '
                      'Dataset or DatasetDict; save it with save_to_disk and point hf: there')
  return dict(loaded)


def canonical_splits(names) -> dict[str, str]:
  """{our split name: the dataset's}: 'valid', 'dev', 'val' are validation, 'testing', 'eval',
  'evaluation' test, 'training' train (as `datasets` names data files), unless the dataset has
  the plain name too; other names are kept with non-word characters as '_'."""
  from datasets.data_files import SPLIT_KEYWORDS  # pylint: disable=g-import-not-at-top

  out = {}
  for canonical, keywords in SPLIT_KEYWORDS.items():
    found = [k for k in keywords if k in names]
    if found:
      out[str(canonical)] = found[0]
  for name in names:
    if name not in out.values():
      key = re.sub(r'\W', '_', name)
      if key in out:
        raise DataError(f'the splits {name!r} and {out[key]!r} both become {key!r}; rename one')
      out[key] = name
  return out


def held_out_rows(num_rows: int, fractions: dict[str, float]) -> dict[str, np.ndarray]:
  """Row indices of train per split ({'train': ..., 'validation': ..., ...}, each ascending).

  The rows are ranked by a fixed hash of their index (splitmix64), so the held-out rows are
  spread over the dataset, the same on every run and machine; the first `held_out_counts` of
  the ranking go to validation, the next to test, the rest stay in train.
  """
  counts = held_out_counts(num_rows, fractions)
  z = np.arange(num_rows, dtype=np.uint64)
  with np.errstate(over='ignore'):
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
  ranked = np.argsort(z, kind='stable')
  out, start = {}, 0
  for split in HELD_OUT:
    if split in counts:
      out[split] = np.sort(ranked[start:start + counts[split]])
      start += counts[split]
  return {'train': np.sort(ranked[start:]), **out}


def _folder_files(path: str) -> list[list]:
  """[relpath, size, mtime_ns] of every regular file under a local folder (hidden ones too)."""
  out = []
  for root, dirs, names in os.walk(path):
    dirs.sort()
    for name in sorted(names):
      full = os.path.join(root, name)
      if os.path.isfile(full):
        st = os.stat(full)
        out.append([os.path.relpath(full, path).replace(os.sep, '/'), st.st_size, st.st_mtime_ns])
  return out


@dataclasses.dataclass(frozen=True)
class Resolved:
  """A checked 'hf:' dataset: what `HFDataset` prepares, and its cache key."""
  dataset: str
  path: str                        # a local folder (absolute) or a hub name
  config_name: str | None
  text_key: str
  source_splits: dict              # {our split: the dataset's split name}
  held_out: dict                   # {split: fraction}: held out of the dataset's train split
  num_rows: dict                   # {our split: documents}, after holding out
  allowed: bool                    # data.hf_allow_download
  cache_key: str


def resolve(data_config) -> Resolved:
  """Loads `data.dataset` (`data_config`: the typed data section; offline unless
  data.hf_allow_download) and checks it: a train split
  with rows, `data.text_key` a text column of every split, enough rows to hold out a missing
  validation / test split. Raises ConfigError or DataError, one line naming the field and the fix."""
  dataset, text_key = data_config.dataset, data_config.text_key
  allowed = data_config.hf_allow_download
  loaded = load_splits(dataset, allowed)
  names = canonical_splits(list(loaded))
  if 'train' not in names:
    raise DataError(f'data.dataset={dataset!r} has no train split (splits: {sorted(loaded)}); '
                    "name the training files train.* (or a split 'train')")
  for split, source in names.items():
    features = loaded[source].features
    if text_key not in features:
      raise ConfigError(f'data.text_key={text_key!r} is not a column of {dataset} (split '
                        f'{source!r}); use one of {sorted(features)}')
    dtype = getattr(features[text_key], 'dtype', None)
    if dtype not in ('string', 'large_string'):
      text_columns = sorted(k for k, v in features.items()
                            if getattr(v, 'dtype', None) in ('string', 'large_string'))
      raise ConfigError(f'data.text_key={text_key!r} is a column of {features[text_key]} in '
                        f'{dataset}, not text; use one of {text_columns or "(no text column)"}')
  empty = [s for s, source in names.items() if s != 'train' and len(loaded[source]) == 0]
  for split in empty:
    log.warning('%s: split %r has no rows: left out', dataset, names[split])
    del names[split]
  num_train = len(loaded[names['train']])
  if not _has_text(loaded[names['train']], text_key):  # (before anything compiles)
    raise DataError(f'data.dataset={dataset!r}: its train split has no text ({num_train:,} rows, '
                    f'{text_key!r} empty in every one), nothing to train on; give it rows with text '
                    '(data.text_key names the column that holds it)')
  held_out = {s: float(getattr(data_config, f'{s}_fraction')) for s in HELD_OUT
              if s not in names and getattr(data_config, f'{s}_fraction') > 0}
  counts = held_out_counts(num_train, held_out)
  if num_train - sum(counts.values()) < 1:
    raise DataError(f'data.dataset={dataset!r} has {num_train} train row(s), too few to hold out '
                    f'{" and ".join(held_out) or "anything"} and keep one for train; add rows, '
                    f'give it those splits, or set data.validation_fraction / data.test_fraction to 0')
  num_rows = {s: len(loaded[source]) for s, source in names.items()}
  num_rows['train'] = num_train - sum(counts.values())
  num_rows.update(counts)
  if held_out:
    log.info('%s: no %s split: holding out %s of the %d train rows', dataset,
             ' or '.join(held_out), ', '.join(f'{n} for {s}' for s, n in counts.items()), num_train)
  path, config_name = parse(dataset)
  key = hashlib.sha256(json.dumps({
      'format': _KEY_FORMAT, 'path': path, 'config_name': config_name, 'text_key': text_key,
      'splits': {s: [source, len(loaded[source]), loaded[source]._fingerprint]  # pylint: disable=protected-access
                 for s, source in sorted(names.items())},
      'held_out': held_out,
      'files': _folder_files(path) if os.path.isdir(path) else None,
  }, sort_keys=True).encode()).hexdigest()[:16]
  return Resolved(dataset=dataset, path=path, config_name=config_name, text_key=text_key,
                  source_splits=names, held_out=held_out, num_rows=num_rows, allowed=allowed,
                  cache_key=key)


def _has_text(rows, text_key: str) -> bool:
  """Whether a row of `rows` (a `datasets.Dataset`) has text in `text_key`: read a batch at a
  time, up to the first that has."""
  for batch in rows.select_columns([text_key]).iter(batch_size=_READ_ROWS):
    if any(batch[text_key]):
      return True
  return False


class HFDataset(text_builder.CheckedTextBuilder, skip_registration=True):
  """The rows of one `Resolved` dataset, one example (document) per row, in the dataset's order."""

  RELEASE_NOTES = {'1.0.0': 'A Hugging Face datasets dataset, one document per row.'}
  SUBDIR = 'hf'
  KEEP_ORDER = True  # the dataset's row order

  @property
  def _resolved(self) -> Resolved:
    return self._checked

  def _text_features(self) -> tuple[str, ...]:
    return (self._resolved.text_key,)

  def _description(self) -> str:
    return f'{self._resolved.dataset} (Hugging Face datasets)'

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    del dl_manager  # loaded by `datasets`
    r = self._resolved
    loaded = load_splits(r.dataset, r.allowed)
    train = loaded[r.source_splits['train']]
    rows = held_out_rows(len(train), r.held_out) if r.held_out else {}
    generators = {}
    for split, source in r.source_splits.items():
      generators[split] = self._generate_examples(loaded[source], rows.get(split))
    for split in r.held_out:
      generators[split] = self._generate_examples(train, rows[split])
    log.info('%s: documents per split %s', r.dataset, r.num_rows)
    return generators

  def _generate_examples(self, ds, indices):
    """The rows of `ds` (those at `indices`, ascending, if given) as (row index, example)."""
    ds = ds.select_columns([self._resolved.text_key])
    order = np.arange(len(ds)) if indices is None else indices
    for start in range(0, len(order), _READ_ROWS):
      chunk = order[start:start + _READ_ROWS]
      rows = (slice(start, start + len(chunk)) if indices is None  # a slice: one Arrow read
              else [int(i) for i in chunk])
      texts = ds[rows][self._resolved.text_key]
      for i, text in self._counted(zip(chunk, texts)):
        yield int(i), {self._resolved.text_key: text or ''}


def preflight(data_config, read: bool = True, base_preflight=None) -> Resolved:
  """The registry's checks of an `hf:` dataset: `resolve` (it loads the dataset whatever `read`
  says: its splits and columns are what is checked)."""
  del read, base_preflight
  return resolve(data_config)


def make_builder(resolved: Resolved, tfds_dir: str, data_config=None) -> HFDataset:
  """The (unprepared or prepared) builder of `resolved`, under tfds_dir/hf/<cache_key> (the
  registry's hook: `data_config` is in `resolved`)."""
  del data_config
  return HFDataset.under(resolved, tfds_dir)
