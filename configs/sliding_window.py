"""Sliding-window attention, π's baseline ("RingAttention" in the π-Attention paper's tables).

    python -m efficient_lm.main --config=configs/sliding_window.py

The same window, context and shared settings as configs/pi_attention.py; no
skips and no gate. Result: measured in the README.
"""

import ml_collections

from efficient_lm.config.base import base_config


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  del config_string
  config = base_config("sliding_window")
  config.data.seq_len = 512         # as configs/pi_attention.py
  config.model.seq_chunk = 8192     # blocks over chunks of 8,192 tokens past that length (long context)
  config.data.batch_size = 4
  config.model.window = 128         # local window: token i sees i - window < j <= i
  return config
