"""Dense causal Transformer baseline on the embedded Shakespeare corpus.

    python -m efficient_lm.main --config=configs/dense.py

Measured with the command above on a 2-core x86 CPU, fresh data_dir, so the
corpus download, ArrayRecord preparation and tokenizer training are included:
12 min 20 s wall clock in all, 700 steps of 8 x 256 tokens at ~2,050 tokens/s,
validation (hamlet, twelfth_night) loss 4.425 nats/token, 2.122 bits per byte.
All default runs side by side: docs/running.md, "Training", "Default runs".
"""

import ml_collections

from efficient_lm.config.base import base_config


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  """No presets: every field is the shared default of efficient_lm/config/base.py."""
  del config_string
  return base_config("dense")
