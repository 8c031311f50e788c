"""What any process of the library needs, knowing no model and no config: the exit statuses
(`exit_codes`), the result on stdout and everything else on stderr (`output`), progress lines
(`progress`), SIGINT and SIGTERM in every phase (`signals`), files that several processes write into
one folder (`files`), figures as strict JSON (`figures`), the jax versions and every private jax API
(`jax_compat`) and jax's devices brought up quietly (`jax_devices`).

A lowest wing, beside `config`: it imports no other part of efficient_lm (`config` included), and
nothing here imports jax at module level (a command's mistakes answer before jax starts). Every
wing above the two may import it (`.importlinter` states the order; docs/architecture.md draws it).
"""
