#!/usr/bin/env bash
# The attention core on a GPU: correctness against the dense reference, then train-step speed.
#
#   bash experiments/gpu_check.sh [PEAK_BF16_TFLOPS]     (default 989: H100 / H200 SXM, dense bf16)
#
# Without a GPU (jax.devices()[0].platform != 'gpu') it says so and exits 0 at once. With one, in
# under 8 minutes:
#   1. ops.core.attend against a dense masked float32 reference on the GPU, float32 and bfloat16
#      inputs, values and the gradients of q, k, v and the priors (an lse cotangent included), for
#      dense causal, sliding window, block-local with lookback, and π with both priors, a few
#      shapes; causal_attention(impl='cudnn') against the reference in bfloat16.
#   2. train-step time (forward, backward, AdamW; `experiments.bench_step.compile_train_step` /
#      `time_steps`) of dense 'cudnn', dense 'flash', π and the sliding window at T = 8K, 32K and
#      128K, bfloat16, B = 1, d_model 1024, 4 layers, 8 heads: a table of tokens/s and MFU. A shape
#      that does not fit (or does not finish in the time left) is reported, not fatal.
# MFU = model FLOPs / step time / peak. Model FLOPs: 6 x parameters x tokens plus the attention's
# 12 x (visible query-key pairs) x head width x heads per layer (forward and backward matmuls).
# The table also shows `bench_step.train_step_flops` (XLA's cost analysis), which counts each
# loop body once: it undercounts the core, whose blocks run in loops.
set -euo pipefail
cd "$(dirname "$0")/.."

platform=$(python -c 'import jax; print(jax.devices()[0].platform)' 2>/dev/null || echo "none")
if [ "$platform" != "gpu" ]; then
  echo "gpu_check: no GPU on this machine (jax platform: $platform); nothing to check."
  exit 0
fi

PEAK_TFLOPS="${1:-989}"
export PYTHONUNBUFFERED=1
timeout 470 python - "$PEAK_TFLOPS" <<'PYTHON'
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from efficient_lm.ops import attention
from efficient_lm.ops import core
from efficient_lm.ops.pattern import Pattern

PEAK = float(sys.argv[1]) * 1e12
START = time.time()
print(f"gpu_check on {jax.devices()[0].device_kind}, bf16 peak {PEAK / 1e12:.0f} TFLOP/s")


def reference(q, k, v, pattern, lp, sp):
  """Dense masked softmax in float32 at full matmul precision: (o, lse)."""
  f32 = lambda x: x.astype(jnp.float32)
  T = q.shape[1]
  pos = jnp.arange(T)
  local = pattern.local_visible(pos[:, None], pos[None])
  skip = pattern.skip_visible(pos[:, None], pos[None])
  with jax.default_matmul_precision("highest"):
    s = jnp.einsum("bqhk,bshk->bhqs", f32(q), f32(k)) * q.shape[-1] ** -0.5
  bias = lambda p: 0.0 if p is None else jnp.swapaxes(p, 1, 2)[..., None]
  s = jnp.where(local, s + bias(lp), jnp.where(skip, s + bias(sp), -jnp.inf))
  lse = jax.nn.logsumexp(s, axis=-1)
  with jax.default_matmul_precision("highest"):
    o = jnp.einsum("bhqs,bshk->bqhk", jnp.exp(s - lse[..., None]), f32(v))
  return o, jnp.swapaxes(lse, 1, 2)


def grads(fn, args, cot_o, cot_lse):
  def loss(*a):
    o, lse = fn(*a)
    return jnp.sum(o.astype(jnp.float32) * cot_o) + jnp.sum(lse * cot_lse), (o, lse)
  argnums = tuple(i for i, a in enumerate(args) if a is not None)
  return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(*args)


def max_rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


failures = 0
print("\n1. core vs dense reference (max |error| / max |reference|)")
print(f"{'pattern':<26}{'dtype':>9}{'shape':>22}{'o':>10}{'lse':>10}{'grads':>10}")
patterns = {"dense causal": Pattern.dense(), "sliding(256)": Pattern.sliding(256),
            "blocks(128, lookback 1)": Pattern.blocks(128, 1), "pi(128, 256, 3 skips)": Pattern.pi(128, 256, 3)}
shapes = [(2, 1024, 4, 64), (1, 2048, 8, 128), (1, 1000, 2, 64)]
with jax.default_matmul_precision("highest"):
  for dtype, tol in ((jnp.float32, 2e-4), (jnp.bfloat16, 3e-2)):
    for name, pattern in patterns.items():
      for B, T, H, K in shapes:
        keys = jax.random.split(jax.random.key(T + H), 6)
        q, k, v = (jax.random.normal(kk, (B, T, H, K), jnp.float32).astype(dtype) for kk in keys[:3])
        lp = sp = None
        if pattern.skips:
          lp, sp = attention.gate_priors(gate_logits_BTH=jax.random.normal(keys[3], (B, T, H)))
        cot_o = jax.random.normal(keys[4], (B, T, H, K))
        cot_lse = jax.random.normal(keys[5], (B, T, H))
        fast = lambda q, k, v, lp, sp, p=pattern: core.attend(q, k, v, p, local_prior=lp, skip_prior=sp)
        slow = lambda q, k, v, lp, sp, p=pattern: reference(q, k, v, p, lp, sp)
        (_, (o, lse)), g = grads(fast, (q, k, v, lp, sp), cot_o, cot_lse)
        f32_args = tuple(None if a is None else a.astype(jnp.float32) for a in (q, k, v, lp, sp))
        (_, (ro, rlse)), rg = grads(slow, f32_args, cot_o, cot_lse)
        errs = (max_rel(o, ro), max_rel(lse, rlse), max(max_rel(a, b) for a, b in zip(g, rg)))
        bad = any(e > tol for e in errs[:2]) or errs[2] > 5 * tol
        failures += bad
        print(f"{name:<26}{jnp.dtype(dtype).name:>9}{str((B, T, H, K)):>22}"
              + "".join(f"{e:>10.1e}" for e in errs) + ("  FAIL" if bad else ""))
  q, k, v = (jax.random.normal(kk, (1, 2048, 8, 128), jnp.bfloat16)
             for kk in jax.random.split(jax.random.key(1), 3))
  err = max_rel(attention.causal_attention(q, k, v, impl="cudnn"),
                attention.causal_attention(q, k, v, impl="reference"))
  failures += err > 3e-2
  print(f"causal_attention cudnn vs reference, bf16 (1, 2048, 8, 128): {err:.1e}"
        + ("  FAIL" if err > 3e-2 else ""))
print(f"correctness: {'all within tolerance' if not failures else f'{failures} FAILED'} "
      f"({time.time() - START:.0f} s)")

print("\n2. train steps, bf16, B=1, d_model 1024, 4 layers, 8 heads, vocab 8192")
from experiments import bench_step  # pylint: disable=wrong-import-position
from experiments.common import load_config  # pylint: disable=wrong-import-position
from flax import nnx  # pylint: disable=wrong-import-position
from efficient_lm import models  # pylint: disable=wrong-import-position

MODELS = [("dense cudnn", "configs/dense.py", {"attention_impl": "cudnn"}),
          ("dense flash", "configs/dense.py", {"attention_impl": "flash"}),
          ("pi", "configs/pi_attention.py", {"window": 256, "period": 512, "num_skips": 4}),
          ("sliding window", "configs/sliding_window.py", {"window": 256})]
D, LAYERS, HEADS, VOCAB = 1024, 4, 8, 8192


def config_for(spec, fields, T):
  config = load_config(spec)
  config.data.update(seq_len=T, batch_size=1, vocab_size=VOCAB)
  config.model.update(d_model=D, num_layers=LAYERS, num_heads=HEADS, dtype="bfloat16", **fields)
  return config


def visible_pairs(pattern, T):
  """Query-key pairs the pattern lets attend over a sequence of T (exact, O(T) work)."""
  p = np.arange(T, dtype=np.int64)
  lo = np.zeros(T, np.int64)
  if pattern.window is not None:
    lo = np.maximum(lo, p - pattern.window + 1)
  pairs = int(np.sum(p - lo + 1))
  for d in pattern.skips:
    pairs += max(0, T - d)
  return pairs


def model_flops(config, pattern):
  model = models.create(config.model, rngs=nnx.Rngs(0))
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  T, K = config.data.seq_len, D // HEADS
  return 6 * params * T + 12 * visible_pairs(pattern, T) * K * HEADS * LAYERS


rows = []
for T in (8192, 32768, 131072):
  for name, spec, fields in MODELS:
    left = 440 - (time.time() - START)
    if left < 30:
      rows.append((name, T, "  skipped: out of time"))
      continue
    pattern = (Pattern.pi(256, 512, 4, seq_len=T) if name == "pi" else
               Pattern.sliding(256) if name == "sliding window" else Pattern.dense())
    try:
      config = config_for(spec, fields, T)
      compiled, state, batch, memory, _ = bench_step.compile_train_step(config)
      times = bench_step.time_steps(compiled, state, batch, repeats=3, give_up_seconds=min(30, left / 4))
      seconds = statistics.median(times)
      flops = model_flops(config, pattern)
      xla = bench_step.train_step_flops(config) if T <= 32768 else float("nan")
      rows.append((name, T, f"{T / seconds:>12,.0f}{seconds * 1e3:>11.1f}{flops / seconds / PEAK:>8.1%}"
                            f"{flops / 1e12:>10.2f}{xla / 1e12:>10.2f}"
                            f"{memory.temp_size_in_bytes / 2**30:>10.2f}"))
    except Exception as error:  # a shape that does not fit is reported, not fatal
      message = str(error).strip().splitlines()[0][:90] if str(error).strip() else type(error).__name__
      rows.append((name, T, f"  did not run: {message}"))
    print(f"  {name} T={T} done ({time.time() - START:.0f} s)", flush=True)

print(f"\n{'model':<16}{'T':>8}{'tokens/s':>12}{'step ms':>11}{'MFU':>8}{'TFLOP':>10}"
      f"{'XLA TFLOP':>10}{'temp GiB':>10}")
for name, T, text in rows:
  print(f"{name:<16}{T:>8}{text}")
print(f"\nMFU: model FLOPs (6 x params x tokens + 12 x visible pairs x K x H x layers) / step time / "
      f"{PEAK / 1e12:.0f} TFLOP/s. XLA TFLOP counts each loop body once (T <= 32K only).")
print(f"gpu_check done in {time.time() - START:.0f} s; correctness failures: {failures}")
sys.exit(1 if failures else 0)
PYTHON
