"""The analytic FLOP count behind MFU: visible pairs against brute force, the recurrence's against
XLA's count of its op, the step's total layer by layer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import build, load_config
from efficient_lm.families import gated_deltanet as gdn_family
from efficient_lm.families import pi_attention as pi_family
from efficient_lm.ops.pattern import Pattern
from efficient_lm.ops.recurrent import chunked
from efficient_lm.training import flops
from test_core import reference_masks


@pytest.mark.parametrize("pattern", [Pattern.dense(), Pattern.sliding(5), Pattern.blocks(4, 1),
                                     Pattern.pi(3, 5, 3)], ids=str)
def test_visible_pairs_count_the_masks(pattern):
  T = 37
  local, skip = reference_masks(pattern, np.arange(T), np.arange(T))
  assert flops.visible_pairs(pattern, T) == int(local.sum() + skip.sum())


def small_run(name: str, preset: str | None = None, **model):
  config = load_config(name, preset)
  config.data.update(seq_len=64, batch_size=2)
  config.model.update(d_model=16, num_heads=2, num_layers=4, **model)
  return build(config)


def test_step_flops_and_peaks():
  """Dense: 6 per parameter and token, and 12 per visible pair, head width and head in every
  layer."""
  run = small_run("dense")
  pairs = 64 * 65 // 2
  assert flops.step_flops(run, 100) == 6 * 100 * 64 * 2 + 4 * 2 * 12 * pairs * 8 * 2
  assert flops.peak_flops("TPU v5 lite") == 197e12 and flops.peak_flops("NVIDIA H200") == 989e12
  assert flops.peak_flops("cpu") is None


def test_step_flops_count_each_layer_as_it_mixes():
  """Gated DeltaNet (no attention pattern at all: its MFU line once raised IndexError) counts
  its recurrence in every layer; its hybrid the window in every hybrid_every-th layer and the
  recurrence in the others; π with doubling periods each layer's own pattern."""
  T, B, H, K = 64, 2, 2, 8
  params = 6 * 100 * T * B
  gdn = small_run("gated_deltanet")
  recurrence = gdn.model.recurrence_flops(T)
  assert recurrence == T * H * gdn_family.train_flops_per_token(K, 2 * K, 64) > 0
  assert flops.step_flops(gdn, 100) == params + 4 * recurrence * B
  assert small_run("gated_deltanet", "mamba2").model.recurrence_flops(T) < recurrence
  hybrid = small_run("gated_deltanet", "hybrid", hybrid_every=2, window=16)
  assert hybrid.model.layer_patterns(T) == (None, Pattern.sliding(16)) * 2
  window = 12 * flops.visible_pairs(Pattern.sliding(16), T) * K * H
  assert flops.step_flops(hybrid, 100) == params + 2 * (recurrence + window) * B
  doubling = small_run("pi_attention", "doubling", window=8, period=4, num_skips=2)
  per_layer = [pi_family.layer_pattern(doubling.model, layer) for layer in range(4)]
  assert len(set(per_layer)) == 4 and doubling.model.layer_patterns(T) == tuple(per_layer)
  assert flops.step_flops(doubling, 100) == params + sum(
      12 * flops.visible_pairs(p, T) * K * H for p in per_layer) * B


def test_no_flops_for_a_model_whose_layers_keep_fewer_positions():
  """The Perceiver-AR family keeps only its latents after layer 1 (and predicts only them):
  parameters x tokens would overstate its work, so it has no count and no MFU; the progress
  line on an accelerator gives its tokens/s per device alone."""
  from efficient_lm.training import metrics  # pylint: disable=import-outside-toplevel
  run = small_run("perceiver_ar", num_latents=16)
  assert not run.model.flops_counted and flops.step_flops(run, 100) is None
  assert small_run("ecp").model.flops_counted
  line = metrics.Progress(0, 10, tokens_per_step=1000, peak_flops=4 * 197e12,
                          num_devices=4).line(3, 2.5, 5000.0)
  assert "(1,250 per device)" in line and "MFU" not in line


@pytest.mark.parametrize("delta,low", [(True, 0.8), (False, 0.5)])
def test_the_recurrences_count_is_the_matmuls_its_chunked_form_runs(delta, low):
  """`train_flops_per_token` / 3 (the forward) against XLA's count of the op's forward (every
  chunk laid out): at most XLA's, which adds the elementwise decays and W S_0 computed again for
  the outputs (and without the delta rule, where W = 0, twice); and most of it at these widths,
  where the matmuls dominate."""
  B, T, H, K, V, C = 1, 256, 2, 64, 128, 64
  keys = jax.random.split(jax.random.key(0), 5)
  q, k = (jax.random.normal(key, (B, T, H, K)) for key in keys[:2])
  v = jax.random.normal(keys[2], (B, T, H, V))
  g = -jax.nn.softplus(jax.random.normal(keys[3], (B, T, H)))
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H)))
  scan = functools.partial(chunked.state_scan, unroll=True)
  forward = lambda *args: chunked.chunked(*args, None, jnp.zeros((B, H, K, V)), C, scan, delta)[0]
  cost = jax.jit(forward).lower(q, k, v, g, beta).compile().cost_analysis()
  xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
  counted = gdn_family.train_flops_per_token(K, V, C, delta) / 3 * B * T * H
  assert low * xla < counted <= xla, (counted, xla)


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
