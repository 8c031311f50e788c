"""The config's declarations: the field machinery (`fields`: a declared field with its default,
meaning and checks; the `Section` base), the four typed sections (`data`, `model`, `train`, `mesh`,
gathered in `sections.Typed`), the logical axes the mesh rules name (`axes`), the ConfigDict
defaults every config file starts from (`base.base_config`, `base.fill_defaults`), loading a config
file by path or shipped name (`files`), and the error every config check raises (`errors`:
`ConfigError`, `require`).

A lowest wing, beside `runtime`: it imports no other part of efficient_lm (`runtime` included),
and no jax. A model family's own config class sits beside its mixer in `models/` and registers
itself there; building all four sections from a ConfigDict (`state.train_state.typed`) therefore
lives above the models.
"""
