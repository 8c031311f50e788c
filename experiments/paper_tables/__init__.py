"""The papers' comparisons at small scale, on the embedded corpus: one row per (config, preset, seed).

    nice -n 19 python -m experiments.paper_tables --pause_file=/tmp/efficient_lm_quiet   # every row
    python -m experiments.paper_tables --tables=bcmt --models=bcmt:256,dense@1 --steps=50
    python -m experiments.paper_tables --bench --tables=pi     # side-by-side train-step tokens/s
    python -m experiments.paper_tables --render                # README tables and plots from the json

One job per module: `specs` (the tables, their rows, claims and commands), `rows` (training and
scoring one row in pausable subprocesses, `experiments.runner`), `store` (the json files),
`metrics` (the rows' numbers: per-position curves, band losses, a claim's metric per seed),
`render` (markdown tables and claims, with `experiments.claims`'s verdict cells), `plots` (the
per-position figures), `bench` (side-by-side tokens/s), `__main__` (the queue and the command
line).

Each row is a real training run, `python -m efficient_lm.main` in a subprocess (the exact command
is stored with the row) with the table's shared settings: the same context, batch, width, depth,
steps and tokens for every model of a table, and for one seed (`train.seed`: initialization and
data order) the same data order. Row keys name the seed: `bcmt:256@1`. After training a second
subprocess scores the row's workdir with `efficient_lm.evaluate` and counts the compiled step's
temporary memory and FLOPs. Resumable and additive: rows are written after every run and kept
unless --force; a row trained but not scored is scored without retraining (`--rescore` rescores
kept rows). `--pause_file=PATH` stops the running subprocess while PATH exists. The per-position
curves go to `<results>_per_position.json`, one row per line. experiments/README.md says what
the tables measured.
"""
