"""The Perceiver-AR family on the embedded Shakespeare corpus (latents = the last num_latents tokens).

    python -m efficient_lm.main --config=configs/perceiver_ar.py            # perceiver_ar
    python -m efficient_lm.main --config=configs/perceiver_ar.py:double
    python -m efficient_lm.main --config=configs/perceiver_ar.py:compressed
    python -m efficient_lm.main --config=configs/perceiver_ar.py:ssplit

Perceiver AR is from "General-purpose, long-context autoregressive modeling with
Perceiver AR" (Hawthorne et al., 2022); the three double-attention variants from
"Efficient Context Propagating Perceiver Architectures for Auto-Regressive
Language Modeling" (the ECP paper).

Only the last num_latents positions of each window are predicted and trained
(and scored in evaluation). Presets:
  (default)   perceiver_ar: layer 1 cross-attends from the latents to the whole window,
              later layers are causal self-attention over the latents only.
  double      double_attention: the history is kept and refined (bidirectionally) in every layer.
  compressed  compressed_double_attention: the history compressed 4x by a learned linear map.
  ssplit      ssplit_double_attention: history self-attention inside 4 disjoint segments.

Result: measured in the README (time, validation bits per byte).
"""

import ml_collections

from efficient_lm.config.base import base_config

PRESETS = {
    None: "perceiver_ar",
    "double": "double_attention",
    "compressed": "compressed_double_attention",
    "ssplit": "ssplit_double_attention",
}


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  name = PRESETS.get(config_string or None)
  if name is None:
    raise ValueError(f"unknown preset {config_string!r} for configs/perceiver_ar.py; "
                     "use double, compressed or ssplit (or none for perceiver_ar)")
  config = base_config(name)
  model = config.model
  model.num_latents = 128           # latents: the last num_latents positions, the only ones predicted
  model.compression = 4             # compressed: history length / compression slots (must divide it)
  model.compression_op = "learned"  # compressed: 'learned' (the paper's map over the whole history:
                                    # O(T^2) parameters) or 'strided' (per group of compression
                                    # tokens: O(compression * d_model) parameters)
  model.num_history_segments = 4    # ssplit: history segments (must divide seq_len - num_latents)
  return config
