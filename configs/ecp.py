"""ECP (Efficient Context Propagating Perceiver) on the embedded Shakespeare corpus.

    python -m efficient_lm.main --config=configs/ecp.py

From "Efficient Context Propagating Perceiver Architectures for Auto-Regressive
Language Modeling" (the ECP paper).

Pieces of seq_len / num_segments tokens; each piece attends to the previous
piece and causally to itself, so context travels one piece further back per
layer. Every position is trained. Presets:
  authors   the authors' code's options: shared key/value projection, RoPE in the first layer only.

Result: measured in the README (time, validation bits per byte).
"""

import ml_collections

from efficient_lm.config.base import base_config


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  config = base_config("ecp")
  model = config.model
  model.num_segments = 4            # pieces per window (must divide seq_len): 64 tokens at seq_len 256
  model.shared_kv = False           # keys and values from one projection (as the authors' code)
  model.rope_first_layer_only = False  # RoPE in layer 1 only (as the authors' code); else every layer
  model.seq_chunk = 8192            # blocks over chunks of 8,192 tokens past that length (long
                                    # context: pieces of at most 8,192 tokens, e.g. num_segments =
                                    # seq_len / 256)
  if config_string in (None, ""):
    return config
  if config_string == "authors":
    model.shared_kv = True
    model.rope_first_layer_only = True
  else:
    raise ValueError(f"unknown preset {config_string!r} for configs/ecp.py; use authors")
  return config
