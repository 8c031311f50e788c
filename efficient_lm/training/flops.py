"""The model FLOPs of a train step, counted analytically, and accelerators' peak rates: MFU.

`step_flops(run, num_params)`: 6 FLOPs per parameter and trained token (forward and backward
matmuls) plus each layer's mixing, from `run.model.layer_patterns`: an attention layer's 12 FLOPs
per visible (query, key) pair, head width and head (q.k and p.v, forward and backward: 2 + 2 + 4 +
4), its pairs counted exactly from its pattern (O(T) work); a layer without attention (a
recurrence) its family's `recurrence_flops`. Rematerialization's recomputation is not counted
(model FLOPs, not hardware FLOPs). None for a model whose layers keep fewer positions than the
sequence (`ModelConfig.flops_counted`: the Perceiver-AR family), where that count would overstate
its work: no MFU for it.
`peak_flops(device_kind)`: the vendor's dense bfloat16 rate, None for an unknown device or a CPU.
"""

import numpy as np

from efficient_lm.config.run import RunConfig
from efficient_lm.ops.pattern import Pattern

PEAK_BF16_TFLOPS = {  # by jax device_kind prefix (vendor figures, dense bfloat16)
    "NVIDIA H100": 989, "NVIDIA H200": 989, "NVIDIA A100": 312, "NVIDIA B200": 2250,
    "TPU v5 lite": 197, "TPU v5p": 459, "TPU v5": 459, "TPU v6 lite": 918, "TPU v4": 275}


def peak_flops(device_kind: str) -> float | None:
  """FLOP/s of one device of `device_kind` (dense bfloat16), or None when unknown."""
  for prefix, tflops in sorted(PEAK_BF16_TFLOPS.items(), key=lambda kv: -len(kv[0])):
    if device_kind.startswith(prefix):
      return tflops * 1e12
  return None


def visible_pairs(pattern: Pattern, T: int) -> int:
  """Query-key pairs a causal `pattern` lets attend over a sequence of T (exact, O(T) work)."""
  p = np.arange(T, dtype=np.int64)
  lo = np.zeros(T, np.int64)
  if pattern.window is not None:
    lo = np.maximum(lo, p - pattern.window + 1)
  if pattern.block_size is not None:
    lo = np.maximum(lo, (p // pattern.block_size - pattern.lookback) * pattern.block_size)
  return int(np.sum(p - lo + 1)) + sum(T - d for d in pattern.skip_offsets(T))


def step_flops(run: RunConfig, num_params: int) -> float | None:
  """Model FLOPs of one train step of `run` (every sequence of the global batch), given its
  parameter count: the parameters' and every layer's mixing; None where they are not counted
  (the module's docstring)."""
  if not run.model.flops_counted:
    return None
  T, B = run.data.seq_len, run.data.batch_size
  H = run.model.num_heads
  K = run.model.d_model // H
  mixing = sum(run.model.recurrence_flops(T) if pattern is None
               else 12 * visible_pairs(pattern, T) * K * H
               for pattern in run.model.layer_patterns(T))
  return float(6 * num_params * T * B + mixing * B)
