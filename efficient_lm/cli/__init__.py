"""What the command lines share and each command's body. `command`: the one skeleton every
command runs on (signals, flags, stdout kept for the result, logging, the phase a stop names, the
exit status); `common`: configs by path or shipped name and one `error: ...` line for every
mistake (absl's `flags_parser`, and `error`/`fail` for the bodies); `help`: `--help` and
`--help=<model>`, read from the config's declarations without importing jax; `resume_file`: a
workdir's own config.json as a config file (`--workdir=W` alone). The bodies of the five commands
(`train_command` with `train_run`, its part that loads jax; `sample_command`; `evaluate_command`
with `long_context_command` and `ruler_command`; `export_command`; `harness_command` with
`harness_model`, lm-eval's `LM` over `efficient_lm.load`): their flags, what they check before jax
starts, what they print and their exit statuses.

The top wing below the five `python -m` modules: it may import every other wing and the face
(`efficient_lm.api`). A body imports its heavy wings inside the functions that need them, each
with its reason, so that `--help` and a mistake on the command line answer before jax starts.
"""
