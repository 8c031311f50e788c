"""The config's declarations and its one typed form: the field machinery (`fields`: a declared
field with its default, meaning and checks; the `Section` base), the four typed sections (`data`,
`model`: the fields every model shares, `train`, `mesh`), `RunConfig` (`run`: the four sections of
a run, built once from a config file's ConfigDict by `run.build`, written to and read back from
config.json; every layer below the command lines takes it or one of its sections), the logical
axes the mesh rules name (`axes`), the ConfigDict defaults every config file starts from
(`base.base_config`), loading a config file by path or shipped name (`files`), and the error
every config check raises (`errors`: `ConfigError`, `require`).

A lowest wing, beside `runtime`: it imports no other part of efficient_lm (`runtime` included),
and no jax. A model family's own config class is declared in `efficient_lm.families` (above this
wing: its attention patterns are `ops`'), so `run.build` takes the families' classes
(`families.CLASSES`) from its caller. `ml_collections` is read here and in the command lines
only (`.importlinter`).
"""
