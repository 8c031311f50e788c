"""π-Attention on the embedded Shakespeare corpus: local window + periodic skips + gate.

From "π-Attention: Periodic Sparse Transformers for Efficient Long-Context Modeling".

    python -m efficient_lm.main --config=configs/pi_attention.py

Measured with the command above on a quiet 2-core x86 CPU, the corpus already prepared,
document ids on: 11 min 0 s wall clock (660 s), 700 steps of 4 x 512 tokens, validation
(hamlet, twelfth_night) loss 4.414 nats/token, 2.117 bits per byte
(`python -m experiments.first_hour --parts=default`).

Long context: `--config.data.seq_len=131072 --config.data.batch_size=1` runs as is
(the blocks run over chunks of `model.seq_chunk` tokens and the loss over chunks of
`train.loss_chunk`; add `--config.model.remat=block` past that).
All default runs side by side: docs/running.md, "Training", "Default runs".

Presets (`configs/pi_attention.py:<preset>`):
  doubling  layer l uses period * 2**l (the growing-period reading of the π-Attention paper's
            O(k n_l + P log n_l) receptive field); default: the same period in every layer.
  paper     a paper-scale setting on WikiText-103 (needs the archive and an accelerator):
            context 4096, window 256, period 512, 4 skips, d_model 512, 8 layers, 8 heads.
            These sizes are this repository's choice, not taken from the paper.
"""

import ml_collections

from efficient_lm.config.base import base_config


def add_pi_fields(config: ml_collections.ConfigDict) -> None:
  model = config.model
  model.window = 128                # local window: token i sees i - window < j <= i
  model.period = 128                # skip distance: token i also sees i - m * period ...
  model.num_skips = 3               # ... for m = 1..num_skips (skips inside the window not repeated)
  model.period_schedule = "constant"  # 'constant', or 'doubling': layer l uses period * 2**l
  model.gate_hidden = 32            # hidden width of the gate MLP (D -> gate_hidden -> heads)
  model.gate = "learned"            # 'learned' (the gate MLP), or 'fixed': g = 0.5, no gate parameters


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  config = base_config("pi_attention")
  config.data.seq_len = 512         # twice the dense baseline's context ...
  config.data.batch_size = 4        # ... at the same tokens per step
  add_pi_fields(config)
  config.model.seq_chunk = 8192     # blocks over chunks of 8,192 tokens past that length (long context)
  if config_string in (None, ""):
    return config
  if config_string == "doubling":
    config.model.period_schedule = "doubling"
    config.model.period = 64        # layer periods 64, 128, 256, 512
  elif config_string == "paper":
    config.data.dataset = "wikitext103"
    config.data.tokenizer_train_bytes = 100_000_000
    config.data.seq_len = 4096
    config.data.batch_size = 8
    config.model.update(dict(d_model=512, num_layers=8, num_heads=8, window=256, period=512,
                             num_skips=4, dtype="bfloat16"))
    config.train.update(dict(num_steps=100_000, learning_rate=6e-4, warmup_steps=2000,
                             log_every=100, eval_every=5000, checkpoint_every=5000))
  else:
    raise ValueError(f"unknown preset {config_string!r} for configs/pi_attention.py; "
                     "use doubling or paper")
  return config
