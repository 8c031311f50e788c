"""Dense causal Transformer baseline on the embedded Shakespeare corpus.

    python -m efficient_lm.main --config=configs/dense.py
    python -m efficient_lm.main --config=configs/dense.py:mqa   # multi-query attention

Measured with the first command above on a 2-core x86 CPU, fresh data_dir, so the
corpus download, ArrayRecord preparation and tokenizer training are included:
12 min 20 s wall clock in all, 700 steps of 8 x 256 tokens at ~2,050 tokens/s,
validation (hamlet, twelfth_night) loss 4.425 nats/token, 2.122 bits per byte.
All default runs side by side: docs/running.md, "Training", "Default runs".

`:mqa` is the same model with one key/value head shared by its 4 query heads
(`model.num_kv_heads=1`, grouped-query attention at its extreme): k/v projections and
the decoding cache a quarter of the default's. Any divisor of model.num_heads works the
same way, e.g. `--config.model.num_kv_heads=2`.
"""

import ml_collections

from efficient_lm.config.base import base_config

PRESETS = ("mqa",)


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  """'' or None: every field is the shared default of efficient_lm/config/base.py; 'mqa':
  multi-query attention."""
  config = base_config("dense")
  if config_string in (None, ""):
    return config
  if config_string not in PRESETS:
    raise ValueError(f"unknown configs/dense.py preset {config_string!r}; use one of "
                     f"{', '.join(PRESETS)}, or none")
  config.model.num_kv_heads = 1     # one key/value head serves every query head
  return config
