"""What a run starts from: `setup` builds the data, the mesh and the train state (restored from
the workdir's latest checkpoint when it has one) into a `Run`, every workdir refusal answered
before anything is written, the train step compiled and checked to fit before any data.
"""

import dataclasses
import json
import logging
from typing import Any

import jax

from efficient_lm import data
from efficient_lm.config.run import RunConfig
from efficient_lm.parallel import distributed
from efficient_lm.parallel import sharding
from efficient_lm.parallel import targets
from efficient_lm.runtime import output
from efficient_lm.runtime import progress as progress_lib
from efficient_lm.state import checkpoint
from efficient_lm.state import train_state
from efficient_lm.state import workdir as workdir_lib
from efficient_lm.training import metrics as metrics_lib
from efficient_lm.training import prepare as config_check
from efficient_lm.training import step_memory

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
  """What the step loop works with; built by `setup`."""
  config: RunConfig  # as it trains: the vocabulary its tokenizer fixed (written to config.json)
  workdir: str
  corpus: Any
  mesh: jax.sharding.Mesh
  layout: str
  built: train_state.Built     # abstract: the shapes, shardings, optimizer and schedule
  state: train_state.TrainState
  train_step: Any               # the compiled step (checked to fit before anything ran)
  ckpt: checkpoint.Checkpointer
  train_iter: Any
  writer: Any
  meta: dict
  rows: tuple[int, int] | None = None  # this process's rows of every batch (per-host input)
  eval_pending: bool = False    # resumed from a stop during the evaluation at this step: redo it
  eval_void: str | None = None  # why train.eval_split is left out (no text), if it is


def setup(run: RunConfig, workdir: str, built: train_state.Built | None = None) -> Run:
  """Data, mesh and train state; the state and data position restored from the workdir if it has
  checkpoints. Every check runs before the workdir is touched (`workdir.Workdir`): a run of
  another model or corpus is refused with the workdir byte-identical, and whatever config.json,
  data.json and the checkpoints' metadata can answer is answered before any data is prepared or
  anything compiles. A resumed state is restored straight into its shardings (no random init
  beside it). `run`, `built`: what `config_check.prepare` returned at the edge (without `built`,
  prepared here); a vocabulary the tokenizer fixes later is a new RunConfig (`with_vocab`)."""
  if built is None:
    run, built = config_check.prepare(run)
  t, asked, mesh, abstract = run.train, run.data, built.mesh, built
  wd = workdir_lib.Workdir(workdir)
  _refuse_early(run, abstract, wd)
  # The data checks that read no more than the config names (a `text:` glob), on process 0.
  data_checks = distributed.primary_first(lambda: data.preflight(asked), "corpus checked",
                                          others=lambda: data.preflight(asked, read=False))
  # Compile the step first, from shapes only: a step that cannot fit stops here, before any data.
  compiled = _compiled_step(run, abstract)
  own = wd.resume_tokenizer(asked)  # resuming: the workdir's tokenizer, whatever the cache holds
  with progress_lib.phase("preparing the data"), output.library_prints_discarded():
    corpus = distributed.primary_first(lambda: data.load(asked, data_checks, own), "data prepared")
  _check_same_corpus(corpus)
  eval_void = data.check_splits(corpus, asked, t.eval_split, t.num_steps)  # (empty train: refused)
  vocab = _vocab_size(run, corpus.tokenizer, wd)
  if vocab < run.data.vocab_size:  # a small corpus: fewer pieces
    log.info("the tokenizer has %d pieces (data.vocab_size=%d): the model's vocabulary is %d",
             corpus.tokenizer.vocab_size, run.data.vocab_size, vocab)
    run = run.with_vocab(vocab)
    abstract = config_check.place(run, mesh)  # the model's checks on the mesh again
    compiled = _compiled_step(run, abstract)
  wd.check_data(corpus.identity, allow_new_data=t.allow_new_data)
  batch_size, seq_len = run.data.batch_size, run.data.seq_len
  rows = sharding.process_rows(mesh, batch_size, seq_len)
  if rows is None:  # every process reads the global batch and places its own slices
    train_iter = corpus.train_iterator(batch_size=batch_size, seed=t.seed)
  else:  # per-host input: this process reads only its rows of every global batch
    train_iter = corpus.train_iterator(batch_size=rows[1] - rows[0], seed=t.seed,
                                       process_index=jax.process_index(),
                                       process_count=jax.process_count())
    log.info("each process reads its own %d of the %d rows of every batch", rows[1] - rows[0],
             batch_size)
  open_checkpoints = lambda: checkpoint.Checkpointer(wd.checkpoints, max_to_keep=t.keep_checkpoints)
  ckpt, restored, meta, saved_meta = None, None, None, {}

  def check_meta(saved: dict) -> None:
    wd.check_model(saved, meta)
    saved_meta.update(saved)

  if wd.has_checkpoints():  # (a workdir without any is not touched before the checks pass)
    meta = workdir_lib.model_meta(run, abstract.state.params)
    ckpt = open_checkpoints()
    with progress_lib.phase("restoring the latest checkpoint"):
      restored = ckpt.restore_latest(abstract.state, check_meta)
  if restored is not None:
    latest, state, data_state = restored
    train_iter.set_state(data_state)
    log.info("resumed from %s at step %d", ckpt.directory, latest)
    _warn_if_rate_jumps(saved_meta.get("learning_rate"), float(abstract.schedule(latest)), latest)
  else:
    state = train_state.initialize(run, abstract)
  meta = meta or workdir_lib.model_meta(run, abstract.state.params)
  if distributed.is_primary():  # every check has passed: now the workdir is written
    # data.json's settings: the corpus-deciding fields as asked (before a small corpus's vocab)
    wd.write(run, corpus.tokenizer, corpus.identity, workdir_lib.corpus_settings(asked))
    if restored is not None:
      moved = metrics_lib.rewind(wd.path, restored[0])
      if moved:
        log.info("moved %d metrics.jsonl lines of steps after %d (the run that was cut short) to "
                 "%s", moved, restored[0], metrics_lib.SUPERSEDED)
  distributed.barrier("workdir written")
  ckpt = ckpt or open_checkpoints()
  distributed.PeerWatch.describe_checkpoints = lambda: checkpoint.describe_committed(ckpt.directory)
  log.info("model %s: %s parameters; %s train tokens; workdir %s", run.model.name,
           f"{abstract.num_params:,}", f"{corpus.num_tokens('train'):,}", wd.path)
  writer = metrics_lib.open_writers(run, wd.path, distributed.is_primary())
  return Run(config=run, workdir=wd.path, corpus=corpus, mesh=mesh,
             layout=abstract.layout, built=abstract, state=state,
             train_step=compiled, ckpt=ckpt, train_iter=train_iter, writer=writer, meta=meta,
             rows=rows, eval_pending=restored is not None and bool(saved_meta.get("eval_pending")),
             eval_void=eval_void)


def _refuse_early(run: RunConfig, abstract: train_state.Built, wd: workdir_lib.Workdir) -> None:
  """The workdir's refusals that config.json, data.json and the checkpoints' metadata can give
  at once (another corpus, tokenizer or model), before any data is prepared or anything compiles.
  The same checks run again, authoritatively, once the corpus is loaded and the state restored."""
  if not wd.has_checkpoints():
    return
  wd.check_settings(run.data, allow_new_data=run.train.allow_new_data)
  saved_meta = checkpoint.latest_meta(wd.checkpoints)
  if saved_meta is None:
    return
  vocab = wd.resumed_vocab_size(run.data.vocab_size)
  if vocab != run.data.vocab_size:  # the model as it will be built once the tokenizer is known
    run = run.with_vocab(vocab)
    abstract = train_state.build(run, abstract.mesh, abstract=True)
  wd.check_model(saved_meta, workdir_lib.model_meta(run, abstract.state.params))


def _check_same_corpus(corpus) -> None:
  """Every process trains on the same corpus and tokenizer: with a `data.data_dir` of each host's
  own, each prepared its own copy; one that differs stops the job before anything is written."""
  differ = distributed.processes_differing(json.dumps(corpus.identity, sort_keys=True))
  if differ:
    raise data.DataError(
        f"process(es) {', '.join(map(str, differ))} prepared another corpus or tokenizer than "
        f"process 0 (data.json identity {json.dumps(corpus.identity, sort_keys=True)} on process "
        f"{jax.process_index()}); with a data.data_dir of each host's own the hosts must see the "
        "same files: put data.data_dir on a filesystem every host sees, or copy process 0's "
        "prepared data.data_dir to the others")


def _vocab_size(run: RunConfig, tokenizer, wd: workdir_lib.Workdir) -> int:
  """The model's vocabulary: the tokenizer's size when it is below data.vocab_size (a small
  corpus), but never below the vocabulary of the checkpoints a run resumes (a fine-tuning run on
  new data, `train.allow_new_data`, keeps their shapes)."""
  vocab = min(run.data.vocab_size, tokenizer.vocab_size)
  saved = wd.saved_config() if wd.has_checkpoints() else None
  if saved is not None:
    vocab = max(vocab, min(run.data.vocab_size, saved.data.vocab_size))
  return vocab


def _compiled_step(run: RunConfig, abstract: train_state.Built):
  """The train step compiled for `abstract` (the train state's shapes), checked to fit a device."""
  what = f"compiling the train step for {targets.platform_of(abstract.mesh.devices.flat)}"
  log.info("%s (%s, seq_len %s, batch %s)...", what, run.model.name,
           f"{run.data.seq_len:,}", run.data.batch_size)
  with progress_lib.phase(what):
    compiled = step_memory.compile_train_step(run, abstract)
  memory = step_memory.report(compiled, run, abstract)
  log.info("%s", step_memory.describe(memory))
  step_memory.check_fits(memory)
  log.info("%s", abstract.describe())
  return compiled


def _warn_if_rate_jumps(saved_rate: float | None, new_rate: float, step: int) -> None:
  """One warning line when the resumed schedule's rate at `step` is >10% off the saved run's."""
  if saved_rate is None:
    return
  if abs(new_rate - saved_rate) > 0.1 * max(abs(saved_rate), 1e-12):
    log.warning("the learning rate jumps on resume at step %d: %.3g in the checkpoint's run, %.3g "
                "now (train.num_steps or the schedule changed; train.schedule='wsd' keeps the rate "
                "when a run is extended in its stable phase)", step, saved_rate, new_rate)
