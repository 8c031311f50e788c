"""The lm-evaluation-harness adapter (`efficient_lm.harness`, `harness_model.EfficientLM`), offline:
local tasks written here as YAML over jsonl files (multiple choice, rolling perplexity,
generate_until with a stop string), each request type against the model's own logits and the
library's scorer, and the command line."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, TINY, build, load_config, subprocess_env

pytest.importorskip("lm_eval")

MC_DOCS = [{"question": "to be or not", "choices": [" to be", " the lord", " sweet prince"], "gold": 0},
           {"question": "good night sweet", "choices": [" prince", " window", " love"], "gold": 0},
           {"question": "what light through", "choices": [" yonder", " hate", " foul"], "gold": 0},
           {"question": "fair is", "choices": [" foul", " night", " art"], "gold": 0}]
PPL_DOCS = [{"text": "thou art the lord of all my love and hate sweet prince good night " * 3},
            {"text": "what light through yonder window breaks\nfair is foul"}]
GEN_DOCS = [{"prompt": "ROMEO:\n", "answer": "thou"}, {"prompt": "HAMLET:\n", "answer": "good"}]


def _write_tasks(folder) -> str:
  """Three local tasks (tiny_mc, tiny_ppl, tiny_gen) and their data under `folder`."""
  tasks = {
      "tiny_mc": (MC_DOCS, """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""),
      "tiny_ppl": (PPL_DOCS, """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""),
      "tiny_gen": (GEN_DOCS, """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""),
  }
  for name, (docs, body) in tasks.items():
    data = os.path.join(folder, f"{name}.jsonl")
    with open(data, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(d) + "\n" for d in docs)
    with open(os.path.join(folder, f"{name}.yaml"), "w", encoding="utf-8") as f:
      f.write(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
              f"    test: {data}\ntest_split: test\n{body}metadata:\n  version: 1.0\n")
  return str(folder)


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
  """HF datasets offline, its cache in a fresh folder (nothing from the hub)."""
  home = tmp_path_factory.mktemp("hf_home")
  env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(home)}
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  yield env
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
  return _write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def workdir(shakespeare_archive, tiny_data_dir, tmp_path_factory):
  """A tiny dense model trained 10 steps (seq_len 32)."""
  from efficient_lm.training import loop as train  # pylint: disable=import-outside-toplevel
  config = load_config("dense")
  archive, sha = shakespeare_archive
  config.data.update(dict(TINY["data"], data_dir=tiny_data_dir, archive=archive, archive_sha256=sha))
  config.model.update(TINY["model"])
  config.train.update(dict(TINY["train"], num_steps=10, eval_every=10, checkpoint_every=10,
                           sample_tokens=0))
  config.mesh.update(TINY["mesh"])
  path = str(tmp_path_factory.mktemp("harness_run"))
  train.train_and_evaluate(build(config), path)
  return path


@pytest.fixture(scope="module")
def lm(workdir):
  from efficient_lm.cli.harness_model import EfficientLM  # pylint: disable=import-outside-toplevel
  return EfficientLM(workdir, batch_size=3)


class _Request:
  def __init__(self, *args):
    self.args = args


def _log_softmax(model, inputs) -> np.ndarray:
  """float64 log-probabilities `[T', V]` of one row of inputs, from the model's own `.logits`."""
  logits = np.asarray(model.logits(np.asarray([inputs])), np.float64)[0]
  logits -= logits.max(-1, keepdims=True)
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def _log_probs(model, ids) -> tuple[np.ndarray, np.ndarray]:
  """(log p(ids[t+1] | ids[:t+1]), whether ids[t+1] is the argmax) for every t."""
  log_p = _log_softmax(model, ids[:-1])
  return log_p[np.arange(len(ids) - 1), ids[1:]], log_p.argmax(-1) == np.asarray(ids[1:])


def test_loglikelihood_is_the_continuations_log_probability_from_the_logits(lm):
  model, eos = lm.lm, lm.eos_id
  long_context = "thou art the lord of all my love and hate " * 6  # longer than seq_len: cut
  pairs = [("good night", " sweet prince"), ("", "what light"), (long_context, " sweet prince"),
           ("fair is ", "foul")]
  got = lm.loglikelihood([_Request(*p) for p in pairs])
  assert len(got) == len(pairs)
  for (context, continuation), (log_p, greedy) in zip(pairs, got):
    ctx, cont = lm._encode_pair(context, continuation)  # pylint: disable=protected-access
    assert cont
    full = ([eos] + ctx + cont)[-(lm.seq_len + 1):]
    token_log_p, right = _log_probs(model, full)
    assert log_p == pytest.approx(token_log_p[-len(cont):].sum(), rel=1e-4, abs=1e-4)
    assert greedy == bool(right[-len(cont):].all())
  assert len(lm._encode(long_context)) > lm.seq_len  # pylint: disable=protected-access


def test_a_continuation_longer_than_the_window_is_refused(lm):
  from efficient_lm.cli.harness_model import HarnessError  # pylint: disable=import-outside-toplevel
  with pytest.raises(HarnessError, match="continuation of .* tokens .* longer than the 32 positions"):
    lm.loglikelihood([_Request("a", " thou art the lord" * 20)])


def test_rolling_perplexity_equals_the_library_scorer_on_the_same_windows(lm):
  from efficient_lm.evaluation import scoring  # pylint: disable=import-outside-toplevel
  text = (PPL_DOCS[0]["text"] + PPL_DOCS[1]["text"] + "\n") * 2
  ids = [int(t) for t in lm.lm.tokenizer.encode(text)]
  assert len(ids) > 2 * lm.seq_len  # several windows, the last one partial
  (log_p,) = lm.loglikelihood_rolling([_Request(text)])
  library = scoring.score_stream(lm.lm.model, np.asarray([lm.eos_id] + ids), context=lm.seq_len,
                                 stride=lm.seq_len, batch_size=2, num_bytes=len(text.encode()),
                                 eos_id=lm.eos_id, pad_id=lm.pad_id, seq_len=lm.seq_len,
                                 document_mask=lm.document_mask)
  assert library["scored_tokens"] == len(ids)
  assert np.exp(-log_p / len(ids)) == pytest.approx(library["perplexity"], rel=1e-5)
  windows = lm.rolling_rows(text)  # every token scored once
  assert sum(float(w["weights"].sum()) for w in windows) == len(ids)
  assert len(windows) == library["num_windows"]


def test_generate_until_cuts_at_the_stop_string_and_batches(lm):
  prompts = ["ROMEO:\n", "HAMLET:\n", "good night"]
  free = lm.lm.generate(prompts, max_new_tokens=8, temperature=0.0)
  stop = next(t[1:3] for t in free if len(t) >= 3)  # a string greedy decoding does produce
  kwargs = {"until": [stop], "max_gen_toks": 8, "do_sample": False}
  got = lm.generate_until([_Request(p, dict(kwargs)) for p in prompts])
  assert got == [t[:t.find(stop)] if stop in t else t for t in free]
  assert any(stop in t for t in free)


def test_simple_evaluate_runs_the_three_local_tasks(lm, task_dir, offline):
  from efficient_lm.cli import harness_command as harness  # pylint: disable=import-outside-toplevel
  del offline
  results = harness.evaluate(lm, ["tiny_mc", "tiny_ppl", "tiny_gen"], include_path=task_dir,
                             include_defaults=False)["results"]
  # multiple choice: acc from the adapter's loglikelihoods, the best choice gold (index 0)
  chosen = []
  for doc in MC_DOCS:
    scores = lm.loglikelihood([_Request(doc["question"], c) for c in doc["choices"]])
    chosen.append(int(np.argmax([s for s, _ in scores])) == doc["gold"])
  assert results["tiny_mc"]["acc,none"] == pytest.approx(np.mean(chosen))
  # rolling: bits per byte = -sum of log p / (ln 2 * bytes), over the documents
  log_p = lm.loglikelihood_rolling([_Request(d["text"]) for d in PPL_DOCS])
  num_bytes = sum(len(d["text"].encode()) for d in PPL_DOCS)
  assert results["tiny_ppl"]["bits_per_byte,none"] == pytest.approx(-sum(log_p) / np.log(2) / num_bytes,
                                                                     rel=1e-6)
  assert results["tiny_ppl"]["word_perplexity,none"] > 1.0
  assert 0.0 <= results["tiny_gen"]["exact_match,none"] <= 1.0


def _docs_blocks() -> dict[str, list[str]]:
  """The fenced blocks of docs/using_a_model.md's `## Evaluate with lm-eval`, by language."""
  with open(os.path.join(REPO, "docs", "using_a_model.md"), encoding="utf-8") as f:
    section = f.read().split("## Evaluate with lm-eval", 1)[1].split("\n## ", 1)[0]
  blocks = {}
  for part in section.split("```")[1::2]:
    language, _, body = part.partition("\n")
    blocks.setdefault(language.strip(), []).append(body)
  return blocks


def test_the_docs_task_and_command_write_lm_evals_results_json(workdir, offline, tmp_path):
  """docs/using_a_model.md's own task YAML, data and command, on the tiny run: its first example,
  which runs offline."""
  blocks = _docs_blocks()
  (yaml,) = [b for b in blocks["yaml"] if "task: capitals" in b]
  command = blocks["bash"][0].strip()
  assert "--tasks=capitals" in command
  os.makedirs(tmp_path / "my_tasks")
  (tmp_path / "my_tasks" / "capitals.yaml").write_text(yaml)
  (tmp_path / "my_tasks" / "capitals.jsonl").write_text(blocks["json"][0])
  env_part, python, *args = command.split()
  assert env_part == "HF_DATASETS_OFFLINE=1" and python == "python"
  args = [f"--workdir={workdir}" if a.startswith("--workdir=") else a for a in args]
  done = subprocess.run([sys.executable, *args, "--limit=3", "--batch_size=4"], cwd=tmp_path,
                        env=subprocess_env(**offline), capture_output=True, text=True, timeout=300,
                        check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((tmp_path / "results" / "capitals.json").read_text())
  assert 0.0 <= results["results"]["capitals"]["acc,none"] <= 1.0
  assert results["n-samples"]["capitals"]["effective"] == 3
  assert json.loads(done.stdout.strip().splitlines()[-1])["capitals"]["acc,none"] == \
      results["results"]["capitals"]["acc,none"]


def test_an_unknown_task_is_one_error_line(task_dir, tmp_path, capsys):
  from efficient_lm.cli import harness_command as harness  # pylint: disable=import-outside-toplevel
  status = harness.cli(workdir=str(tmp_path), tasks="tiny_mc,no_such_task", include_path=task_dir,
                       include_defaults=False, output_file=str(tmp_path / "r.json"))
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and len(err) == 1, err
  assert err[0].startswith("error: --tasks: no_such_task is not among") and "--include_path" in err[0]
  assert not (tmp_path / "r.json").exists()


@pytest.mark.slow  # (lm-eval indexes its few thousand task files: 20 s on a quiet CPU, 50 s loaded)
def test_a_task_whose_data_cannot_be_had_offline_is_one_error_line(tmp_path):
  """The docs' hub task with the hub offline and an empty cache: one line naming the task and
  why, status 2, before the model loads (the workdir here is not even a model)."""
  env = subprocess_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
  done = subprocess.run([sys.executable, "-m", "efficient_lm.harness", f"--workdir={tmp_path}",
                         "--tasks=lambada_openai", f"--output={tmp_path / 'r.json'}"], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=300, check=False)
  lines = done.stderr.strip().splitlines()
  assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
  assert lines[0].startswith("error: --tasks: lambada_openai needs data that is not in the local "
                             "Hugging Face cache (" + str(tmp_path / "hf"))
  assert "offline (HF_DATASETS_OFFLINE=1, HF_HUB_OFFLINE=1)" in lines[0] and "--include_path" in lines[0]
  assert done.stdout == "" and not (tmp_path / "r.json").exists()


def test_a_local_task_whose_file_is_missing_is_one_error_line(tmp_path, capsys, offline):
  from efficient_lm.cli import harness_command as harness  # pylint: disable=import-outside-toplevel
  del offline
  (tmp_path / "lost.yaml").write_text(
      "task: lost\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
      f"    test: {tmp_path / 'no_such.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
      'doc_to_text: "{{q}}"\ndoc_to_choice: "{{c}}"\ndoc_to_target: 0\n')
  status = harness.cli(workdir=str(tmp_path), tasks="lost", include_path=str(tmp_path),
                       include_defaults=False, output_file=str(tmp_path / "r.json"))
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and len(err) == 1, err
  assert err[0].startswith("error: --tasks: lost's data cannot be read (") and "data_files" in err[0]


def test_the_hub_cannot_be_reached_and_offline_are_told_apart(monkeypatch):
  from efficient_lm.cli import harness_command as harness  # pylint: disable=import-outside-toplevel
  for flag in harness.OFFLINE_FLAGS:
    monkeypatch.delenv(flag, raising=False)
  error = ConnectionError("Couldn't reach 'EleutherAI/lambada_openai' on the Hub (LocalEntryNotFoundError)")
  line = harness.unavailable("lambada_openai", error)
  assert "the Hugging Face Hub cannot be reached" in line and "downloaded offline" not in line
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  assert "cannot be downloaded offline (HF_HUB_OFFLINE=1)" in harness.unavailable("lambada_openai", error)
  # A local file that is not there is not the network's fault, offline or not.
  line = harness.unavailable("lost", FileNotFoundError("Unable to find '/data/lost.jsonl'"))
  assert line.startswith("--tasks: lost's data cannot be read (FileNotFoundError: Unable to find")


@pytest.mark.slow  # (another family compiled: ~15 s)
def test_perceiver_ar_scores_in_its_latents(lm):
  """A Perceiver-AR model (untrained: the layout is what is checked) predicts only its last
  num_latents positions: rows right-aligned, rolling windows of num_latents targets, the same
  perplexity as the library's scorer with that stride, continuations scored from those logits."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from efficient_lm import api, models  # pylint: disable=import-outside-toplevel
  from efficient_lm.evaluation import scoring  # pylint: disable=import-outside-toplevel
  from efficient_lm.cli.harness_model import EfficientLM  # pylint: disable=import-outside-toplevel
  config = load_config("perceiver_ar")
  config.data.update(dict(TINY["data"], vocab_size=int(lm.lm.config.data.vocab_size)))
  config.model.update(dict(TINY["model"], num_latents=8))
  from efficient_lm.config import run as config_run  # pylint: disable=import-outside-toplevel
  from efficient_lm import families  # pylint: disable=import-outside-toplevel
  from efficient_lm.inference import restore  # pylint: disable=import-outside-toplevel
  run = config_run.build(config, families.CLASSES)
  perceiver = EfficientLM(api.LoadedModel(restore.Restored(
      models.create(run.model, rngs=nnx.Rngs(0)), lm.lm.tokenizer, run, None, "untrained")),
                          batch_size=2)
  assert (perceiver.num_logits, perceiver.right_align) == (8, True)
  text = (PPL_DOCS[0]["text"] + PPL_DOCS[1]["text"]) * 2
  ids = [int(t) for t in lm.lm.tokenizer.encode(text)]
  (log_p,) = perceiver.loglikelihood_rolling([_Request(text)])
  library = scoring.score_stream(perceiver.lm.model, np.asarray([lm.eos_id] + ids), context=32,
                                 stride=8, batch_size=2, num_bytes=len(text.encode()),
                                 eos_id=lm.eos_id, pad_id=lm.pad_id, seq_len=32,
                                 document_mask=perceiver.document_mask)
  assert library["scored_tokens"] == len(ids)
  assert np.exp(-log_p / len(ids)) == pytest.approx(library["perplexity"], rel=1e-5)
  ctx, cont = perceiver._encode_pair("good night", " sweet prince")  # pylint: disable=protected-access
  ((got, _),) = perceiver.loglikelihood([_Request("good night", " sweet prince")])
  full = [lm.eos_id] + ctx + cont
  row = [lm.eos_id] * (32 - len(full) + 1) + full  # right-aligned: eos on the left
  log_p = _log_softmax(perceiver.lm, row[:-1])  # the last 8 positions only
  assert log_p.shape[0] == 8
  want = sum(log_p[8 - len(cont) + j, t] for j, t in enumerate(cont))
  assert got == pytest.approx(want, rel=1e-4, abs=1e-4)


def test_lm_evals_registry_builds_the_model_from_model_args(workdir, lm):
  from lm_eval.api.registry import get_model  # pylint: disable=import-outside-toplevel
  built = get_model("efficient_lm").create_from_arg_string(f"path={workdir},batch_size=2",
                                                           {"batch_size": None, "device": None})
  assert type(built) is type(lm) and built.batch_size == 2 and built.seq_len == 32
  pair = [_Request("good night", " sweet prince")]
  assert built.loglikelihood(pair)[0][0] == pytest.approx(lm.loglikelihood(pair)[0][0], rel=1e-6)
