"""A run's state and where it lives: the train state (the model's parameters, the optimizer and its
state, built in one place: `train_state`, with `optimizer`), its checkpoints (`checkpoint`: every
use of Orbax), and the workdir's own files (`workdir`: config.json, data.json, the tokenizer, the
checks a workdir answers before jax starts).

It may import `models`, `data`, `parallel`, `ops`, `config` and `runtime`; nothing that trains,
samples or scores (`inference`, `training`, `evaluation` build on it). `workdir` stays light: a
workdir's mistakes answer before jax starts.
"""
