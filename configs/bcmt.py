"""BCMT: blockwise local attention + exponential causal memory (docs/architecture.md), and HOnly.

From "Blockwise Causal Memory Transformer" (the BCMT paper; HOnly is its ablation).

    python -m efficient_lm.main --config=configs/bcmt.py            # block 256 (the paper's pick)
    python -m efficient_lm.main --config=configs/bcmt.py:128        # presets: 64, 128, 256, 512
    python -m efficient_lm.main --config=configs/bcmt.py:honly      # ablation: no memory, block 256
    python -m efficient_lm.main --config=configs/bcmt.py:honly128   # ablation at another block size

The context is 1024 tokens (the BCMT paper's), 2 windows per step: the same 2,048
tokens per step, steps, optimizer and model width as configs/dense.py (256
tokens x 8), so the two runs see the same data in the same number of steps. At
block 256 a window holds 4 blocks, so the memory has blocks to carry; at 256
tokens a block would be the whole window and BCMT would be HOnly.

Measured with the first command above on a 2-core x86 CPU shared with two
other training jobs (so the wall clock is about 2.5x an idle machine's): the
default (block 256) ran 700 steps in 2,987 s at 400-690 tokens/s; validation (hamlet,
twelfth_night) loss 4.449 nats/token, 2.133 bits per byte (dense at 256 tokens:
4.425, 2.122). At step 350 BCMT had 4.696 vs HOnly's 4.713 (same settings).
All default runs side by side: docs/running.md, "Training", "Default runs".
"""

import ml_collections

from efficient_lm.config.base import base_config

BLOCK_SIZES = ("64", "128", "256", "512")


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  """'' or None: block 256; '64' | '128' | '256' | '512': that block; 'honly[<block>]': the ablation."""
  preset = config_string or "256"
  honly = preset.startswith("honly")
  block = preset[len("honly"):] if honly else preset
  block = block or "256"
  if block not in BLOCK_SIZES:
    raise ValueError(f"unknown configs/bcmt.py preset {config_string!r}; use one of "
                     f"{', '.join(BLOCK_SIZES)}, honly, or honly<block> such as honly128")

  config = base_config("honly" if honly else "bcmt")
  config.data.seq_len = 1024        # the paper's context: 4 blocks of 256, 8 of 128
  config.data.batch_size = 2        # 2 x 1024 = dense's 8 x 256 tokens per step
  config.model.block_size = int(block)  # L: local attention and summaries per block; divides seq_len
  config.model.seq_chunk = 8192     # blocks over chunks of 8,192 tokens past that length (long context)
  config.model.alpha = 0.8          # memory decay per block, in (0, 1); unused by honly
  return config
