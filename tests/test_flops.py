"""The analytic FLOP count behind MFU: visible pairs against brute force, the step's total."""

import ml_collections
import numpy as np
import pytest

from efficient_lm import flops
from efficient_lm.ops.pattern import Pattern
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
