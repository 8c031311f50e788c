"""`python -m efficient_lm.export` and `efficient_lm.load`: safetensors out, the same model in."""

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import efficient_lm
from conftest import REPO, _tiny_sections, build, load_config, subprocess_env
from efficient_lm import api
from efficient_lm import models
from efficient_lm.cli import export_command
from efficient_lm.evaluation import scoring
from efficient_lm.inference import export
from efficient_lm.inference import export_format
from efficient_lm.inference import restore as restore_lib
from efficient_lm.runtime import signals
from efficient_lm.state import train_state
from efficient_lm.state import workdir as workdir_lib
from efficient_lm.training import loop as train

# The module's trained fixture is built once: its tests run on one xdist worker (--dist=loadgroup).
pytestmark = pytest.mark.xdist_group("export_runs")

DOCS = os.path.join(REPO, "docs", "using_a_model.md")


@pytest.fixture(scope="module")
def run(shakespeare_archive, tiny_data_dir, tmp_path_factory):
  """A tiny π-Attention run (6 steps, checkpoints at 3 and 6) trained on 2 devices, parameters
  sharded over them (mesh.fsdp=2), and its export (the library call), restored onto one."""
  config = load_config("pi_attention")
  overrides = dict(num_steps=6, checkpoint_every=3, eval_every=6, log_every=3, sample_tokens=0)
  for section, fields in _tiny_sections(shakespeare_archive, tiny_data_dir, overrides).items():
    config[section].update(fields)
  config.model.update(window=8, period=8, num_skips=2)  # windows and skips inside seq_len=32
  config.mesh.fsdp = 2
  workdir = str(tmp_path_factory.mktemp("pi_run"))
  train.train_and_evaluate(build(config), workdir)
  out = str(tmp_path_factory.mktemp("exports") / "pi")
  summary = export.export(workdir, out)
  return {"workdir": workdir, "export": out, "summary": summary,
          "config": workdir_lib.Workdir(workdir).saved_config()}


@pytest.fixture(scope="module")
def loaded(run):
  return {"workdir": efficient_lm.load(run["workdir"]), "export": efficient_lm.load(run["export"])}


def _ids(lm, rows=2, seed=0):
  """`[rows, seq_len]` token ids: a document start, another document from the middle on."""
  ids = np.random.default_rng(seed).integers(3, lm.tokenizer.vocab_size, size=(rows, lm.seq_len))
  ids[:, 0] = lm.eos_id
  ids[:, lm.seq_len // 2] = lm.eos_id
  return ids


def _tensors(folder):
  """{name: array} of every safetensors file in `folder`."""
  out = {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      out.update(load_file(os.path.join(folder, name)))
  return out


def _error(call) -> str:
  with pytest.raises(api.LoadError) as e:
    call()
  assert "\n" not in str(e.value)
  return str(e.value)


# What an export holds.


def test_export_holds_every_parameter_once_named_by_module_path(run):
  out, config = run["export"], run["config"]
  assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors",
                                     "tokenizer.model"]
  tensors = _tensors(out)
  num_params = train_state.build(config, abstract=True).num_params
  assert sum(t.size for t in tensors.values()) == num_params == run["summary"]["num_params"]
  assert sum(t.nbytes for t in tensors.values()) == run["summary"]["total_size"]
  assert {t.dtype for t in tensors.values()} == {np.dtype(np.float32)}
  m = config.model
  assert tensors["embed.embedding"].shape == (m.vocab_size, m.d_model)
  assert tensors["final_norm.scale"].shape == (m.d_model,)
  head_dim = m.d_model // m.num_heads  # the stacked layers: one tensor, the layer axis first
  assert tensors["blocks.mixer.attn.qkv.kernel"].shape == (m.num_layers, m.d_model, 3, m.num_heads,
                                                           head_dim)
  # The values are the checkpoint's: the parameters the sampler's loader restores.
  restored = restore_lib.restore(run["workdir"], sharded=True, exports=False)  # as the sampler
  model, step = restored.model, restored.step
  assert step == 6
  np.testing.assert_array_equal(tensors["embed.embedding"], np.asarray(model.embed.embedding[...]))
  with open(os.path.join(run["workdir"], "config.json")) as f:
    saved = json.load(f)
  with open(os.path.join(out, "config.json")) as f:
    written = json.load(f)
  assert written.pop("format") == {"name": "efficient_lm.safetensors", "version": 1, "step": 6,
                                   "dtype": "float32", "weights": "model.safetensors"}
  assert written == saved
  with open(os.path.join(out, "tokenizer.model"), "rb") as a, \
      open(os.path.join(run["workdir"], "tokenizer.model"), "rb") as b:
    assert a.read() == b.read()
  with open(os.path.join(run["workdir"], "metrics.jsonl")) as f:
    final = [r for r in map(json.loads, f) if "eval_loss" in r][-1]
  with open(os.path.join(out, "README.md")) as f:
    card = f.read()
  assert f"Parameters: {num_params:,}, stored as float32" in card
  assert f"{final['eval_bits_per_byte']:.4f} bits per byte at step 6" in card
  assert "Training: step 6" in card and "`shakespeare`" in card
  assert "the layer axis first (here `blocks.mixer.attn.out.kernel` is `[2, 32, 32]`)" in card
  assert f"python -m efficient_lm.export --workdir={run['workdir']} --out={out}" in card


# Loading: the workdir and the export give the same model.


def test_load_of_the_workdir_and_of_the_export_give_identical_logits(run, loaded):
  ids = _ids(loaded["workdir"])
  from_workdir = loaded["workdir"].logits(ids)
  from_export = loaded["export"].logits(ids)
  V = run["config"].model.vocab_size
  assert from_workdir.shape == (2, 32, V) and from_workdir.dtype == np.float32
  assert np.isfinite(from_workdir).all() and from_workdir.std() > 0
  assert float(np.abs(from_workdir - from_export).max()) == 0.0
  # ... and they are the model's: the sampler's loader, its forward pass with document ids.
  model = restore_lib.restore(run["workdir"], sharded=True, exports=False).model
  reference = model(jax.numpy.asarray(ids), segment_ids_BT=jax.numpy.asarray(
      np.cumsum(ids == loaded["workdir"].eos_id, axis=1, dtype=np.int32)))
  np.testing.assert_allclose(from_workdir, np.asarray(reference), rtol=1e-5, atol=1e-5)
  for lm in loaded.values():
    assert lm.step == 6 and lm.seq_len == 32 and lm.eos_id == lm.tokenizer.eos_id
    assert lm.config.model.name == "pi_attention" and lm.num_params == run["summary"]["num_params"]


def test_a_sharded_export_loads_the_same(run, loaded, tmp_path):
  out = tmp_path / "sharded"
  limit = 40_000  # the embedding table (49,152 bytes) alone in its file, the rest cut under it
  summary = export.export(run["workdir"], str(out), max_shard_bytes=limit)
  files = summary["files"]
  shards = [f for f in files if f.endswith(".safetensors")]
  assert len(shards) >= 3 and files[-1] == "model.safetensors.index.json"
  assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                    for i in range(1, len(shards) + 1)]
  assert not (out / "model.safetensors").exists()
  with open(out / "model.safetensors.index.json") as f:
    index = json.load(f)
  tensors = _tensors(str(out))
  assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
  for shard in shards:
    held = load_file(str(out / shard))
    assert len(held) == 1 or sum(t.nbytes for t in held.values()) <= limit
    assert {k for k, f in index["weight_map"].items() if f == shard} == set(held)
  assert sum(t.size for t in tensors.values()) == run["summary"]["num_params"]
  ids = _ids(loaded["export"], seed=1)
  assert float(np.abs(efficient_lm.load(str(out)).logits(ids)
                      - loaded["export"].logits(ids)).max()) == 0.0


def test_an_earlier_step_in_bfloat16(run, loaded, tmp_path):
  out = tmp_path / "step3"
  summary = export.export(run["workdir"], str(out), step=3, dtype="bfloat16")
  assert summary["step"] == 3 and summary["dtype"] == "bfloat16"
  at_3 = efficient_lm.load(run["workdir"], step=3)
  assert at_3.step == 3
  tensors = _tensors(str(out))
  params = export_format.flat_names(nnx.state(at_3.model))
  assert set(tensors) == set(params)
  for name, tensor in tensors.items():  # the step-3 checkpoint's values, rounded to bfloat16
    assert tensor.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(tensor, np.asarray(params[name][1]).astype(ml_dtypes.bfloat16))
  lm = efficient_lm.load(str(out))
  assert lm.step == 3
  ids = _ids(lm, seed=2)
  rounding = np.abs(lm.logits(ids) - at_3.logits(ids)).max()
  three_steps = np.abs(loaded["workdir"].logits(ids) - at_3.logits(ids)).max()
  assert 0 < rounding < 0.5 * three_steps


# Weights written elsewhere: the same path, one clear error for names and shapes that differ.


def test_weights_written_elsewhere_load_and_mismatches_are_named(run, loaded, tmp_path):
  tensors = load_file(os.path.join(run["export"], "model.safetensors"))

  def folder(name, weights):
    path = tmp_path / name
    path.mkdir()
    for file in ("config.json", "tokenizer.model"):  # the workdir's: no format block
      shutil.copy(os.path.join(run["workdir"], file), path / file)
    save_file(weights, str(path / "model.safetensors"))
    return str(path)

  foreign = efficient_lm.load(folder("foreign", dict(tensors)))
  assert foreign.step is None
  ids = _ids(foreign, seed=3)
  assert float(np.abs(foreign.logits(ids) - loaded["export"].logits(ids)).max()) == 0.0

  renamed = dict(tensors)
  renamed["embed.table"] = renamed.pop("embed.embedding")
  message = _error(lambda: efficient_lm.load(folder("renamed", renamed)))
  assert "has no tensor 'embed.embedding' ((384, 32) float32)" in message and "1 missing" in message
  extra = dict(tensors, **{"blocks.extra.bias": np.zeros(3, np.float32)})
  message = _error(lambda: efficient_lm.load(folder("extra", extra)))
  assert "holds tensor 'blocks.extra.bias', which the model of" in message
  reshaped = dict(tensors, **{"final_norm.scale": np.ones(31, np.float32)})
  message = _error(lambda: efficient_lm.load(folder("reshaped", reshaped)))
  assert "tensor 'final_norm.scale' in" in message
  assert "has shape (31,) F32, the model of" in message and "expects (32,) float32" in message
  integer = dict(tensors, **{"final_norm.scale": np.ones(32, np.int32)})
  message = _error(lambda: efficient_lm.load(folder("integer", integer)))
  assert "has shape (32,) I32" in message and "expects (32,) float32" in message
  message = _error(lambda: efficient_lm.load(str(tmp_path)))
  assert "holds neither model.safetensors (an export) nor config.json" in message
  message = _error(lambda: efficient_lm.load(run["export"], step=3))
  assert "is an export, which holds one step" in message
  message = _error(lambda: efficient_lm.load(run["workdir"], step=4))
  assert "--step=4 is not a committed checkpoint" in message and "(it has 3, 6)" in message


# Scoring and generation.


def test_score_is_the_evaluation_of_each_text_as_a_file(loaded, tmp_path, fake_work):
  lm = loaded["export"]
  texts = [fake_work("hamlet", lines=12), "ROMEO:\nGood night."]
  scores = lm.score(texts, batch_size=3)
  assert len(scores["texts"]) == 2
  nll = tokens = 0.0
  for text, got in zip(texts, scores["texts"]):
    file = tmp_path / "text.txt"
    file.write_text(text, encoding="utf-8")
    stream, num_bytes = scoring.read_text_file(str(file), lm.tokenizer)
    expected = scoring.score_stream(lm.model, stream, context=32, stride=32, batch_size=4,
                                    num_bytes=num_bytes, eos_id=lm.eos_id,
                                    pad_id=lm.tokenizer.pad_id,
                                    seq_len=32, document_mask=True)
    assert got["tokens"] == expected["scored_tokens"] == len(stream) - 1
    assert got["bytes"] == num_bytes
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert got["bits_per_byte"] == pytest.approx(expected["bits_per_byte"], rel=1e-6)
    nll += got["loss"] * got["tokens"]
    tokens += got["tokens"]
  assert scores["texts"][0]["tokens"] > 2 * lm.seq_len  # the long text took several windows
  assert scores["tokens"] == tokens and scores["loss"] == pytest.approx(nll / tokens, rel=1e-9)
  assert scores["bits_per_byte"] == pytest.approx(
      nll / np.log(2) / sum(len(t.encode()) for t in texts), rel=1e-9)
  again = lm.score(texts[::-1] + texts, batch_size=5)  # other batches: the same figures per text
  for got, want in zip(again["texts"], scores["texts"][::-1] + scores["texts"]):
    assert got["tokens"] == want["tokens"] and got["loss"] == pytest.approx(want["loss"], rel=1e-6)
  with pytest.raises(ValueError, match=r"texts\[1\] is empty"):
    lm.score(["a", ""])


def test_greedy_generation_follows_the_logits_and_stops(loaded):
  lm = loaded["export"]
  prompts = ["thou art", "what light through yonder window"]  # ragged: decoded together
  prompts_ids = [[int(t) for t in lm.tokenizer.encode(p)] for p in prompts]
  rows = [[lm.eos_id, *ids] for ids in prompts_ids]
  ended = [False, False]
  for _ in range(8):  # the uncached reference: a full forward pass per new token (causal: the
    batch = [r + [lm.tokenizer.pad_id] * (lm.seq_len - len(r)) for r in rows]  # padding unseen)
    logits = lm.logits(batch)
    for b, r in enumerate(rows):
      if not ended[b]:  # a row ends with its document (the end-of-document token)
        r.append(int(np.argmax(logits[b, len(r) - 1, :lm.tokenizer.vocab_size])))
        ended[b] = r[-1] == lm.eos_id
  expected = [lm.tokenizer.decode([t for t in r[1:] if t != lm.eos_id])
              [len(lm.tokenizer.decode(ids)):] for r, ids in zip(rows, prompts_ids)]
  assert lm.generate(prompts, max_new_tokens=8, temperature=0.0) == expected
  assert len(expected[0]) >= 4
  stop = expected[0][len(expected[0]) // 2:][:2]
  cut = [e[:e.find(stop)] if stop in e else e for e in expected]
  assert lm.generate(prompts, max_new_tokens=8, temperature=0.0, stop=["\x00never", stop]) == cut
  assert lm.generate(prompts[0], max_new_tokens=8, temperature=0.0, stop=stop) == cut[0]


def test_bad_input_is_one_clear_error(loaded):
  lm = loaded["export"]
  for ids, message in (([1, 2, 3], r"must be a non-empty int array \[batch, tokens\]"),
                       (np.zeros((1, 33), np.int32), "more than the model's seq_len=32"),
                       ([[2, 384]], r"token id 384 is outside the model's vocabulary \[0, 384\)")):
    with pytest.raises(ValueError, match=message):
      lm.logits(ids)
  with pytest.raises(ValueError, match="wrap one text as"):
    lm.score("a text")
  with pytest.raises(ValueError, match="max_new_tokens=0 must be an integer >= 1"):
    lm.generate(["a"], max_new_tokens=0)


# The command line and the docs.


def _one_error_line(capsys) -> str:
  captured = capsys.readouterr()
  lines = captured.err.strip().splitlines()
  assert captured.out == "" and len(lines) == 1 and lines[0].startswith("error: "), lines
  return lines[0]


def test_refused_exports_are_one_line_and_status_2_and_write_nothing(run, tmp_path, capsys,
                                                                    monkeypatch):
  untrained = tmp_path / "untrained"
  untrained.mkdir()
  for name in ("config.json", "tokenizer.model"):
    shutil.copy(os.path.join(run["workdir"], name), untrained / name)
  previous = tmp_path / "previous"
  export.export(run["workdir"], str(previous), step=3)
  new = str(tmp_path / "new")
  cases = [
      (dict(workdir=run["workdir"], out=str(previous)), f"--out={previous} holds an export "
       "already; give a new folder, or add --overwrite to replace it"),
      (dict(workdir=str(untrained), out=new), "has no checkpoints yet"),
      (dict(workdir=run["export"], out=new), f"--workdir={run['export']} is an export (it holds "
       "model.safetensors or model.safetensors.index.json), not a training workdir: there is "
       f"nothing to export, efficient_lm.load('{run['export']}') reads it as it is"),
      (dict(workdir=run["workdir"], out=new, step=4), "--step=4 is not a committed checkpoint of "
       f"{run['workdir']}/checkpoints (it has 3, 6)"),
      (dict(workdir=run["workdir"], out=new, dtype="int8"), "--dtype=int8 is not an export dtype"),
      (dict(workdir=run["workdir"], out=new, max_shard_bytes=0), "--max_shard_bytes=0 must be at "
       "least 1"),
  ]
  before = _snapshot(tmp_path)
  for kwargs, message in cases:
    assert export_command.cli(**kwargs) == 2, kwargs
    assert message in _one_error_line(capsys), kwargs
  assert _snapshot(tmp_path) == before  # nothing written, no temporary folder left
  # An export that fails once the weights are written leaves nothing behind, the old folder kept.
  def fail(*args, **kwargs):
    raise OSError("disk full")
  monkeypatch.setattr(export, "model_card", fail)
  for target, overwrite in ((new, False), (str(previous), True)):
    with pytest.raises(OSError, match="disk full"):
      export.export(run["workdir"], target, overwrite=overwrite)
  monkeypatch.undo()
  assert _snapshot(tmp_path) == before


def _snapshot(folder) -> dict:
  """{path under `folder`: the sha256 of a file, '/' for a folder}, of everything in it."""
  out = {}
  for root, dirs, files in os.walk(folder):
    for name in dirs:
      out[os.path.relpath(os.path.join(root, name), folder)] = "/"
    for name in files:
      with open(os.path.join(root, name), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
      out[os.path.relpath(os.path.join(root, name), folder)] = digest
  return out


def test_an_export_never_deletes_what_it_did_not_write(run, tmp_path, capsys):
  """The issue's case (`--out=<the workdir> --overwrite` deleted the run) and a user's folder,
  through the command itself: status 2, one line, both folders byte-identical."""
  workdir = run["workdir"]
  mine = tmp_path / "mine"
  (mine / "notes").mkdir(parents=True)
  (mine / "keep.txt").write_text("mine")
  (mine / "notes" / "a.md").write_text("also mine")
  (mine / "README.md").write_text("an export's name, a user's file")
  state = lambda: {"workdir": _snapshot(workdir), "mine": _snapshot(mine),
                   "tmp": sorted(os.listdir(tmp_path)),
                   "parent": sorted(os.listdir(os.path.dirname(workdir)))}
  before = state()
  assert "checkpoints/6" in before["workdir"] and "metrics.jsonl" in before["workdir"]
  commands = [
      ([f"--out={workdir}"], f"--out={workdir} is a training workdir: an export never writes into "
       "a workdir (its checkpoints, metrics.jsonl and data.json are the run's), with or without "
       f"--overwrite; give a folder outside it, e.g. --out={workdir}_export"),
      ([f"--out={workdir}/checkpoints"], f"--out={workdir}/checkpoints is inside the training "
       f"workdir {workdir}: an export never writes"),
      ([f"--out={workdir}/exported"], f"--out={workdir}/exported is inside the training workdir"),
      ([f"--out={mine}"], f"--out={mine} holds keep.txt, notes (2 of its 3 entries are not an "
       "export's): --overwrite replaces only a folder that holds exactly a previous export, and "
       "this one is left as it is; give a new or empty folder"),
  ]
  for args, message in commands:
    for overwrite in ("--overwrite", "--nooverwrite"):
      done = subprocess.run([sys.executable, "-m", "efficient_lm.export", f"--workdir={workdir}",
                             *args, overwrite], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env=subprocess_env(), check=False)
      lines = [l for l in done.stderr.splitlines() if l.strip()]
      assert done.returncode == 2 and done.stdout == "", (args, done.stderr[-2000:])
      assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), (args, lines)
  assert state() == before
  # Another run's workdir, and a folder of weights no export wrote (a config.json without the
  # format block), are refused the same way from the library call.
  other = tmp_path / "other_run"
  other.mkdir()
  for name in ("config.json", "data.json", "metrics.jsonl"):
    shutil.copy(os.path.join(workdir, name), other / name)
  foreign = tmp_path / "foreign"
  foreign.mkdir()
  for name in ("config.json", "tokenizer.model"):
    shutil.copy(os.path.join(workdir, name), foreign / name)
  shutil.copy(os.path.join(run["export"], "model.safetensors"), foreign / "model.safetensors")
  for out, message in ((other, f"--out={other} is a training workdir"),
                       (foreign, f"--out={foreign} holds a config.json that no export wrote (no "
                        "format block naming efficient_lm.safetensors)")):
    held = _snapshot(out)
    with pytest.raises(export.ExportError, match=re.escape(message)):
      export.export(workdir, str(out), overwrite=True)
    assert _snapshot(out) == held
  assert sorted(os.listdir(tmp_path)) == ["foreign", "mine", "other_run"]


def test_overwrite_replaces_a_previous_export_and_a_stop_keeps_it_whole(run, tmp_path, capsys,
                                                                       monkeypatch):
  out = tmp_path / "pi"
  export.export(run["workdir"], str(out), step=3, max_shard_bytes=40_000)  # sharded, step 3
  previous = _snapshot(out)
  assert "model.safetensors.index.json" in previous
  # A stop while the new weights are written (after the first file): the previous export whole.
  from safetensors import numpy as safetensors_numpy  # pylint: disable=import-outside-toplevel
  save_file_before = safetensors_numpy.save_file
  written = []

  def stopped_after_one(tensors, path, **kwargs):
    if written:
      raise signals.Interrupted("SIGTERM", "exporting")
    save_file_before(tensors, path, **kwargs)
    written.append(path)

  monkeypatch.setattr(safetensors_numpy, "save_file", stopped_after_one)
  with pytest.raises(signals.Interrupted):
    export.export(run["workdir"], str(out), overwrite=True, max_shard_bytes=40_000)
  monkeypatch.undo()
  assert len(written) == 1 and os.path.dirname(written[0]) != str(out)  # written beside it
  assert _snapshot(out) == previous and os.listdir(tmp_path) == ["pi"]
  # A failure at the rename into place: the previous export is put back.
  rename = os.rename

  def fails_into_place(src, dst):
    if str(dst) == str(out) and src.endswith(".tmp"):
      raise OSError("stopped at the swap")
    rename(src, dst)

  monkeypatch.setattr(os, "rename", fails_into_place)
  with pytest.raises(OSError, match="stopped at the swap"):
    export.export(run["workdir"], str(out), overwrite=True)
  monkeypatch.undo()
  assert _snapshot(out) == previous and os.listdir(tmp_path) == ["pi"]
  # --overwrite replaces it: one file now, step 6, nothing of the sharded one left.
  assert export_command.cli(workdir=run["workdir"], out=str(out), overwrite=True) == 0
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert summary["step"] == 6 and summary["out"] == str(out)
  assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors",
                                     "tokenizer.model"]
  assert _snapshot(out) == _snapshot(run["export"]) | {"README.md": _snapshot(out)["README.md"]}
  assert os.listdir(tmp_path) == ["pi"]


def test_what_an_export_stopped_at_once_left_is_set_right_by_the_next(run, tmp_path, capsys):
  """A SIGKILL between the two renames leaves the previous export renamed aside (.old) and the new
  one unfinished or unrenamed (.tmp): the next export of that --out puts the old one back and
  removes the other. Folders of a live process, another host, or holding a stranger's file stay."""
  dead = subprocess.Popen(["true"])  # a process id that no longer runs
  dead.wait()
  host = socket.gethostname()
  out = tmp_path / "pi"
  aside = lambda pid, kind, who=host, tag="0123abcd": tmp_path / f".pi.{who}.{pid}.{tag}.{kind}"
  shutil.copytree(run["export"], aside(dead.pid, "old"))
  shutil.copytree(run["export"], aside(dead.pid, "tmp"))
  kept = [aside(dead.pid, "tmp", who="otherhost"), aside(os.getpid(), "tmp"),
          aside(dead.pid, "tmp", tag="4567cdef")]
  for folder in kept:
    shutil.copytree(run["export"], folder)
  (kept[-1] / "keep.txt").write_text("mine")
  assert export_command.cli(workdir=run["workdir"], out=str(out)) == 2
  assert "holds an export already" in _one_error_line(capsys)  # the previous one, back in place
  assert _snapshot(out) == _snapshot(run["export"])
  assert sorted(os.listdir(tmp_path)) == sorted(["pi"] + [f.name for f in kept])


def _code_blocks(section: str, language: str) -> list[str]:
  with open(DOCS, encoding="utf-8") as f:
    text = f.read()
  body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
  return re.findall(rf"```{language}\n(.*?)```", body, re.S)


@pytest.mark.slow  # the export command in a subprocess
def test_the_docs_commands(run, tmp_path):
  """docs/using_a_model.md's Export command (the console script's module, in a subprocess) and its
  Load, Export and Generate Python, on the tiny run."""
  where = {"runs/pi_attention": run["workdir"], "exports/pi_attention": str(tmp_path / "doc")}

  def placed(code):
    for name, path in where.items():
      code = code.replace(name, path)
    return code

  (command,) = _code_blocks("Export", "bash")
  argv = placed(command).split()
  assert argv[:3] == ["python", "-m", "efficient_lm.export"]
  done = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True,
                        timeout=300, env=subprocess_env(), check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  summary = json.loads(done.stdout.strip().splitlines()[-1])
  assert summary["files"] == ["model.safetensors"] and summary["step"] == 6
  assert summary["num_params"] == run["summary"]["num_params"]
  assert f"exported step 6 of {run['workdir']} to {where['exports/pi_attention']}" in done.stderr
  assert load_file(os.path.join(where["exports/pi_attention"], "model.safetensors")).keys() == \
      _tensors(run["export"]).keys()
  # The same command again: refused, one line, status 2, before jax is imported.
  again = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=subprocess_env(), check=False)
  assert again.returncode == 2 and again.stdout == ""
  assert [l for l in again.stderr.splitlines() if l.strip()] == [
      f"error: --out={where['exports/pi_attention']} holds an export already; give a new folder, "
      "or add --overwrite to replace it"]
  for section in ("Load", "Export", "Generate"):
    for code in _code_blocks(section, "python"):
      exec(compile(placed(code), DOCS, "exec"), {})  # pylint: disable=exec-used


def test_import_efficient_lm_stays_light():
  """`import efficient_lm` and the export command's module (what runs before its flags and its
  refusals) import none of the heavy libraries."""
  code = ("import sys, efficient_lm, efficient_lm.export; "
          "print(sorted(m for m in ('jax', 'flax', 'orbax', 'numpy') if m in sys.modules))")
  done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                        timeout=60, check=True)
  assert done.stdout.strip() == "[]"
  assert callable(efficient_lm.load)


@pytest.mark.slow  # a training run for each family
@pytest.mark.parametrize("name", sorted({e.config.__module__: n for n, e in reversed(
    models.REGISTRY.items())}.values()))  # each family module's first registered model
def test_every_family_exports_and_loads_the_same(name, shakespeare_archive, tiny_data_dir,
                                                 tmp_path):
  from test_models import CONFIG_OF, FAMILY_FIELDS  # pylint: disable=import-outside-toplevel
  config = load_config(*CONFIG_OF.get(name, (name,)))
  overrides = dict(num_steps=2, checkpoint_every=2, eval_every=2, sample_tokens=0)
  for section, fields in _tiny_sections(shakespeare_archive, tiny_data_dir, overrides).items():
    config[section].update(fields)
  config.model.update(FAMILY_FIELDS.get(name, {}))
  train.train_and_evaluate(build(config), str(tmp_path / "run"))
  summary = export.export(str(tmp_path / "run"), str(tmp_path / "export"))
  assert summary["num_params"] == train_state.build(build(config), abstract=True).num_params
  from_workdir, from_export = efficient_lm.load(str(tmp_path / "run")), efficient_lm.load(
      str(tmp_path / "export"))
  ids = _ids(from_workdir)
  logits = from_workdir.logits(ids)
  assert logits.shape[0] == 2 and logits.shape[2] == config.model.vocab_size
  assert float(np.abs(logits - from_export.logits(ids)).max()) == 0.0
  text = "ROMEO:\nGood night, good night! parting is such sweet sorrow " * 4
  assert from_workdir.score([text]) == from_export.score([text])


@pytest.mark.slow  # a training run with a Hugging Face tokenizer
def test_a_tokenizer_json_travels_with_the_export(shakespeare_archive, tiny_data_dir, tmp_path):
  from test_bring_tokenizer import _train_byte_level_bpe  # pylint: disable=import-outside-toplevel
  config = load_config("pi_attention")
  overrides = dict(num_steps=2, checkpoint_every=2, eval_every=2, sample_tokens=0)
  for section, fields in _tiny_sections(shakespeare_archive, tiny_data_dir, overrides).items():
    config[section].update(fields)
  config.model.update(window=8, period=8, num_skips=2)
  config.data.tokenizer = _train_byte_level_bpe(str(tmp_path / "tokenizer.json"))
  workdir, out = str(tmp_path / "run"), str(tmp_path / "export")
  train.train_and_evaluate(build(config), workdir)
  assert export.export(workdir, out)["tokenizer"] == ["tokenizer.json"]
  assert "tokenizer.model" not in os.listdir(out)
  with open(os.path.join(out, "tokenizer.json"), "rb") as a, \
      open(os.path.join(workdir, "tokenizer.json"), "rb") as b:
    assert a.read() == b.read()
  from_workdir, from_export = efficient_lm.load(workdir), efficient_lm.load(out)
  text = "ROMEO:\nGood night, good night! parting is such sweet sorrow"
  ids = from_export.tokenizer.encode(text)
  np.testing.assert_array_equal(ids, from_workdir.tokenizer.encode(text))
  assert from_export.eos_id == from_workdir.eos_id and from_export.tokenizer.decode(ids) == text
  row = [[from_export.eos_id, *ids][:from_export.seq_len]]
  assert float(np.abs(from_export.logits(row) - from_workdir.logits(row)).max()) == 0.0


@pytest.mark.slow  # five fresh processes (one imports jax): 15 s
def test_what_opens_a_bfloat16_export_is_what_the_docs_say(run, tmp_path):
  """docs/using_a_model.md: numpy's readers open float32 and float16 exports as they are; a
  bfloat16 one, in a fresh process, only after `import ml_dtypes` (the docs' code), or through
  safetensors.flax."""
  (code,) = [c for c in _code_blocks("Export", "python") if "ml_dtypes" in c]
  folders = {"float32": run["export"]}
  for dtype in ("float16", "bfloat16"):
    folders[dtype] = str(tmp_path / dtype)
    export.export(run["workdir"], folders[dtype], dtype=dtype)

  def fresh(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=False, env=subprocess_env())

  plain = ("from safetensors.numpy import load_file\n"
           "print(load_file({!r})['embed.embedding'].dtype)")
  for dtype, folder in folders.items():
    done = fresh(plain.format(os.path.join(folder, "model.safetensors")))
    if dtype == "bfloat16":
      assert done.returncode == 1
      assert "TypeError: data type 'bfloat16' not understood" in done.stderr.splitlines()[-1]
    else:
      assert done.returncode == 0 and done.stdout.strip() == dtype, done.stderr[-2000:]
  bf16 = os.path.join(folders["bfloat16"], "model.safetensors")
  docs = fresh(code.replace("exports/pi_attention/model.safetensors", bf16)
               + "\nprint(sorted({str(t.dtype) for t in tensors.values()}))")
  assert docs.returncode == 0 and docs.stdout.strip() == "['bfloat16']", docs.stderr[-2000:]
  flax = fresh(f"from safetensors.flax import load_file\nprint(load_file({bf16!r})"
               "['embed.embedding'].dtype)")
  assert flax.returncode == 0 and flax.stdout.strip() == "bfloat16", flax.stderr[-2000:]
