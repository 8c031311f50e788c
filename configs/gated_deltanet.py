"""Gated DeltaNet on the embedded Shakespeare corpus: a gated delta-rule recurrence, no attention.

From "Gated Delta Networks: Improving Mamba2 with Delta Rule" (Yang, Kautz, Hatamizadeh, ICLR 2025).

    python -m efficient_lm.main --config=configs/gated_deltanet.py

Measured with the command above (512 tokens a row run whole: `model.seq_chunk` applies past it) on
a quiet 2-core AMD EPYC, the corpus already prepared, document ids on: 9 min 46 s wall clock (586
s), 700 steps of 4 x 512 tokens, validation (hamlet, twelfth_night) loss 4.359 nats/token, 2.090
bits per byte (one run; docs/running.md, "Default runs").
1M tokens of context compile within 16 GiB on one CPU device (11.27 GiB in sequence chunks of
1,024; docs/long_context.md) and on one v5e chip (9.26 GiB in chunks of 8,192;
docs/accelerators.md). Decoding keeps 573,504 bytes a row at any context (docs/architecture.md,
"Gated DeltaNet").

Long context: `--config.data.seq_len=131072 --config.data.batch_size=1` runs as is (the blocks
run over chunks of `model.seq_chunk` tokens, the state carried from chunk to chunk, and the loss
over chunks of `train.loss_chunk`; add `--config.model.remat=block` past that). Decoding keeps a
constant state per layer whatever the context.

Presets (`configs/gated_deltanet.py:<preset>`):
  hybrid   every 4th layer a sliding-window layer (model.window), the others Gated DeltaNet
           (model.hybrid_mixer='pi_attention' makes them π layers).
  mamba2   the ablation: Mamba-2's gated linear recurrence S <- exp(g) S + k v^T, no delta rule.
"""

import ml_collections

from efficient_lm.config.base import base_config
from efficient_lm.configs.pi_attention import add_pi_fields

PRESETS = ("hybrid", "mamba2")


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  config = base_config("gated_deltanet")
  config.data.seq_len = 512         # as configs/pi_attention.py: 4 x 512 tokens a step
  config.data.batch_size = 4
  model = config.model
  model.conv_size = 4               # taps of the short causal convolution on q, k and v
  model.chunk_size = 64             # tokens per chunk of the recurrence's chunked form
  model.value_ratio = 2             # value head width = 2 x the key head width (the paper's)
  model.delta_rule = True           # False: Mamba-2's gated linear recurrence (the ablation)
  model.hybrid_every = 0            # every k-th layer a model.hybrid_mixer layer (0: none)
  model.hybrid_mixer = "sliding_window"  # the hybrid layers: 'sliding_window' or 'pi_attention'
  model.recurrent_impl = "auto"     # the state scan: 'auto' (kernel on TPU), 'xla', 'pallas'
  add_pi_fields(config)             # the hybrid layers' window and skips (unused without hybrid_every)
  # Blocks over chunks of 1,024 tokens past that length, the state carried from chunk to chunk,
  # each chunk recomputed in the backward pass: the same function, and at 16K tokens 1.2-1.3x
  # faster than chunks of 8,192 and 1.5-2.9x faster than the whole sequence at once on a 2-core
  # CPU (runs on two days), where recomputing a small chunk costs less than reading stored
  # activations back (docs/long_context.md, "Measured"; accelerators may want larger chunks: not
  # measured there).
  model.seq_chunk = 1024
  if config_string in (None, ""):
    return config
  if config_string == "hybrid":
    model.hybrid_every = 4
  elif config_string == "mamba2":
    model.delta_rule = False
  else:
    raise ValueError(f"unknown preset {config_string!r} for configs/gated_deltanet.py; "
                     f"use {' or '.join(PRESETS)}")
  return config
