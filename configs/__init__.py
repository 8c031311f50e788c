"""The configs, one file per model family: `get_config(preset) -> ConfigDict`.

Installed with the package as `efficient_lm.configs` (so `--config=pi_attention` or
`--config=bcmt:128` works without a checkout); from a checkout, `--config=configs/<name>.py`.
"""
