"""The analytic FLOP count behind MFU: visible pairs against brute force, the step's total."""

import ml_collections
import numpy as np
import pytest

from efficient_lm.ops.pattern import Pattern
from efficient_lm.training import flops
from test_core import reference_masks


@pytest.mark.parametrize("pattern", [Pattern.dense(), Pattern.sliding(5), Pattern.blocks(4, 1),
                                     Pattern.pi(3, 5, 3)], ids=str)
def test_visible_pairs_count_the_masks(pattern):
  T = 37
  local, skip = reference_masks(pattern, np.arange(T), np.arange(T))
  assert flops.visible_pairs(pattern, T) == int(local.sum() + skip.sum())


def test_step_flops_and_peaks():
  config = ml_collections.ConfigDict({"data": {"seq_len": 8, "batch_size": 2},
                                      "model": {"num_heads": 2, "d_model": 8, "num_layers": 2}})
  pairs = 8 * 9 // 2
  assert flops.step_flops(config, 100, [Pattern.dense()]) == 6 * 100 * 16 + 2 * 2 * 12 * pairs * 4 * 2
  assert flops.peak_flops("TPU v5 lite") == 197e12 and flops.peak_flops("NVIDIA H200") == 989e12
  assert flops.peak_flops("cpu") is None


def test_the_progress_line_reports_mfu_on_accelerators():
  """With a peak rate (an accelerator) the line adds tokens/s per device and MFU: FLOPs per step x
  steps per second over the devices' peak; without one (a CPU) it does not."""
  from efficient_lm.training import metrics  # pylint: disable=import-outside-toplevel
  on_tpu = metrics.Progress(0, 10, tokens_per_step=1000, step_flops=2e12, peak_flops=4 * 197e12,
                            num_devices=4)
  # 5,000 tokens/s = 5 steps/s = 1e13 FLOP/s of 7.88e14.
  assert on_tpu.mfu(5000.0) == pytest.approx(1e13 / 7.88e14)
  assert "(1,250 per device, MFU 1.3%)" in on_tpu.line(3, 2.5, 5000.0)
  on_cpu = metrics.Progress(0, 10, tokens_per_step=1000)
  assert on_cpu.mfu(5000.0) is None and "MFU" not in on_cpu.line(3, 2.5, 5000.0)
