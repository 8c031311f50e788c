"""efficient_lm: a JAX/Flax model zoo of efficient long-context language models."""

__version__ = "0.1.0"


def load(path: str, *, step: int | None = None):
  """A trained model from a training workdir (its latest checkpoint, or `step`) or a folder that
  `python -m efficient_lm.export` wrote: an `efficient_lm.api.LoadedModel` with `.logits`,
  `.score`, `.generate`, `.tokenizer`, `.config`, `.step`, `.seq_len` and `.eos_id`
  (docs/using_a_model.md). Imports jax on first use: `import efficient_lm` stays light."""
  return _api().load(path, step=step)


def train(config, workdir: str) -> dict:
  """Trains a config file's ConfigDict (its `get_config()`, edited as `--config.*` overrides
  would) or a `config.run.RunConfig` in `workdir`, checked as the training command checks it,
  and returns the final evaluation: `efficient_lm.api.train` (docs/operations.md). Imports jax
  on first use."""
  return _api().train(config, workdir)


def _api():
  """`efficient_lm.api`, the package's face, on first use."""
  # Imported here: `import efficient_lm` stays light (no jax).
  from efficient_lm import api  # pylint: disable=import-outside-toplevel
  return api
