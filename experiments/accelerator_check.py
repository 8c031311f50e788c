"""On a lent GPU or TPU, in one short run: the attention backends against the reference, then
train-step speed of every model against dense, MFU, and peak memory against the compiled estimate.

    bash experiments/accelerator_check.sh            # what a lent device runs (under 8 minutes)
    python -m experiments.accelerator_check --quick  # tiny sizes on any platform (the test runs it)

1. Backends on the device: `core.attend` on `auto` (splash on TPU, gpu on GPU) and on `xla`
   against a float32 masked reference at full matmul precision, float32 and bfloat16, values,
   lse and the gradients of q, k, v and the priors (cotangents on o and lse), for dense
   causal, a sliding window, blocks with lookback and π.
2. Train steps (`step_memory.compile_train_step`: the step `efficient_lm.train` runs), bfloat16,
   B=1, d_model 1024, 4 layers, 8 heads, vocab 8192, remat 'block', every config's sequence
   and loss chunks: π, the sliding window, BCMT, HOnly and ECP with `attention_impl='auto'`,
   against dense with 'auto', at T = 4K, 32K and 128K; tokens/s, the ratio to dense at the same
   T, MFU = analytic model FLOPs / step time / the chip's peak, and the device's peak bytes in
   use against the compiled step's estimate (`step_memory.report`). A shape that does not fit,
   or does not finish in the time left, is reported, not fatal.

Model FLOPs: 6 x parameters x tokens, plus attention's 12 x (visible query-key pairs) x head
width x heads per layer (the forward's two matmuls, the backward's four). Writes one JSON summary
(`--out`, default experiments/results/accelerator_check_<platform>.json) and prints a table.
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from efficient_lm import models, sharding, step_memory, targets, train_state
from efficient_lm.ops import attention, core
from efficient_lm.ops.core import backends
from efficient_lm.ops.pattern import Pattern
from experiments.common import REPO, load_config

PEAK_BF16_TFLOPS = {  # by jax device_kind prefix (vendor figures, dense bfloat16)
    "NVIDIA H100": 989, "NVIDIA H200": 989, "NVIDIA A100": 312, "NVIDIA B200": 2250,
    "TPU v5 lite": 197, "TPU v5p": 459, "TPU v5": 459, "TPU v6 lite": 918, "TPU v4": 275}

MODELS = [("pi_attention", "configs/pi_attention.py"), ("sliding_window", "configs/sliding_window.py"),
          ("bcmt", "configs/bcmt.py"), ("honly", "configs/bcmt.py:honly"), ("ecp", "configs/ecp.py"),
          ("dense", "configs/dense.py")]


def peak_tflops(kind: str) -> float | None:
  for prefix, tflops in sorted(PEAK_BF16_TFLOPS.items(), key=lambda kv: -len(kv[0])):
    if kind.startswith(prefix):
      return float(tflops)
  return None


# 1. Backends against the reference.

def reference(q, k, v, pattern, lp, sp):
  return core.attend(*(x.astype(jnp.float32) for x in (q, k, v)), pattern, impl="reference",
                     local_prior=lp, skip_prior=sp)


def _values_and_grads(fn, args, cot_o, cot_lse):
  def loss(*a):
    o, lse = fn(*a)
    return jnp.sum(o.astype(jnp.float32) * cot_o) + jnp.sum(lse * cot_lse), (o, lse)
  argnums = tuple(i for i, a in enumerate(args) if a is not None)
  (_, (o, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(*args)
  return o, lse, grads


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def check_backends(platform: str, shapes, patterns) -> list[dict]:
  rows = []
  impls = sorted({backends.resolve("auto", platform), "xla"})
  with jax.default_matmul_precision("highest"):
    for dtype, tol in ((jnp.float32, 2e-4), (jnp.bfloat16, 3e-2)):
      for name, pattern in patterns.items():
        for B, T, H, K in shapes:
          keys = jax.random.split(jax.random.key(T + H), 6)
          q, k, v = (jax.random.normal(kk, (B, T, H, K), jnp.float32).astype(dtype)
                     for kk in keys[:3])
          lp = sp = None
          if pattern.skips:
            lp, sp = attention.gate_priors(gate_logits_BTH=jax.random.normal(keys[3], (B, T, H)))
          cot_o = jax.random.normal(keys[4], (B, T, H, K))
          cot_lse = jax.random.normal(keys[5], (B, T, H))
          f32 = tuple(None if a is None else a.astype(jnp.float32) for a in (q, k, v, lp, sp))
          ro, rlse, rg = _values_and_grads(lambda *a, p=pattern: reference(*a[:3], p, *a[3:]),
                                           f32, cot_o, cot_lse)
          for impl in impls:
            fast = lambda q, k, v, lp, sp, p=pattern, i=impl: core.attend(
                q, k, v, p, local_prior=lp, skip_prior=sp, impl=i)
            fallbacks = sum(core.FALLBACKS.values())
            o, lse, g = _values_and_grads(fast, (q, k, v, lp, sp), cot_o, cot_lse)
            errors = (_rel(o, ro), _rel(lse, rlse), max(_rel(a, b) for a, b in zip(g, rg)))
            rows.append({"pattern": name, "impl": impl, "dtype": jnp.dtype(dtype).name,
                         "shape": [B, T, H, K], "o": errors[0], "lse": errors[1],
                         "grads": errors[2], "fell_back": sum(core.FALLBACKS.values()) > fallbacks,
                         "ok": errors[0] <= tol and errors[1] <= tol and errors[2] <= 5 * tol})
  return rows


# 2. Train steps.

def visible_pairs(pattern: Pattern, T: int) -> int:
  """Query-key pairs `pattern` lets attend over a sequence of T (exact, O(T) work)."""
  p = np.arange(T, dtype=np.int64)
  lo = np.zeros(T, np.int64)
  if pattern.window is not None:
    lo = np.maximum(lo, p - pattern.window + 1)
  if pattern.block_size is not None:
    lo = np.maximum(lo, (p // pattern.block_size - pattern.lookback) * pattern.block_size)
  return int(np.sum(p - lo + 1)) + sum(max(0, T - d) for d in pattern.skips)


def model_flops(config, num_params: int) -> float:
  T, H = config.data.seq_len, config.model.num_heads
  K = config.model.d_model // H
  patterns = list(models.attention_patterns(config.model))
  layers = [patterns[min(i, len(patterns) - 1)] for i in range(config.model.num_layers)]
  attention_flops = sum(12 * visible_pairs(p, T) * K * H for p in layers)
  return 6.0 * num_params * T * config.data.batch_size + attention_flops * config.data.batch_size


def config_for(spec: str, T: int, args):
  config = load_config(spec)
  config.data.update(seq_len=T, batch_size=1, vocab_size=args.vocab_size)
  config.model.update(d_model=args.d_model, num_layers=args.num_layers, num_heads=args.num_heads,
                      dtype="bfloat16", remat="block", attention_impl="auto")
  config.mesh.update(data=1, fsdp=1, tensor=1, context=1)
  if config.model.name == "ecp":
    config.model.num_segments = max(1, T // 256)
  if config.model.get("seq_chunk", 0):
    config.model.seq_chunk = min(config.model.seq_chunk, T)
  config.train.loss_chunk = min(config.train.loss_chunk, T)
  return config


def time_model(name: str, spec: str, T: int, args, deadline: float) -> dict:
  row = {"model": name, "seq_len": T}
  left = deadline - time.time()
  if left < 30:
    return {**row, "skipped": "out of time"}
  try:
    config = config_for(spec, T, args)
    built = train_state.build(config, sharding.single_device_mesh())
    compiled = step_memory.compile_train_step(config, built)
    estimate = step_memory.report(compiled, config, built)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab_size, (1, T + 1)).astype(np.int32)
    batch = sharding.shard_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                                  "weights": np.ones((1, T), np.float32)}, built.mesh)
    state = built.state
    state, metrics = compiled(state, batch)  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(args.repeats):
      if time.time() + (times[-1] if times else 0) > deadline:
        break
      start = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - start)
    seconds = statistics.median(times) if times else float("nan")
    stats = jax.local_devices()[0].memory_stats() or {}
    flops = model_flops(config, built.num_params)
    peak = peak_tflops(jax.local_devices()[0].device_kind)
    row.update(step_seconds=seconds, tokens_per_sec=T / seconds, model_tflop=flops / 1e12,
               mfu=(flops / seconds / (peak * 1e12)) if peak else None,
               attention_backend=estimate["attention_backend"],
               estimate_bytes=estimate["per_device_total_bytes"],
               peak_bytes_in_use=stats.get("peak_bytes_in_use"), loss=float(metrics["loss"]))
  except Exception as error:  # pylint: disable=broad-except  (reported, not fatal)
    message = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    row["error"] = message
    traceback.print_exc(limit=2)
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes, any platform (tests)")
  parser.add_argument("--seq_lens", default="4096,32768,131072")
  parser.add_argument("--d_model", type=int, default=1024)
  parser.add_argument("--num_layers", type=int, default=4)
  parser.add_argument("--num_heads", type=int, default=8)
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--budget_seconds", type=float, default=440.0)
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)
  start = time.time()
  device = jax.local_devices()[0]
  platform = targets.platform_of([device])
  shapes = [(2, 1024, 4, 64), (1, 2048, 8, 128), (1, 1000, 2, 64)]
  patterns = {"dense causal": Pattern.dense(), "sliding(256)": Pattern.sliding(256),
              "blocks(128, lookback 1)": Pattern.blocks(128, 1),
              "pi(128, 256, 3 skips)": Pattern.pi(128, 256, 3)}
  if args.quick:
    shapes = [(1, 200, 2, 16)]
    patterns = {"sliding(32)": Pattern.sliding(32), "pi(16, 32, 3 skips)": Pattern.pi(16, 32, 3)}
    args.seq_lens, args.d_model, args.num_layers, args.num_heads = "512", 64, 2, 2
    args.vocab_size, args.repeats = 512, 1
  print(f"accelerator_check on {device.device_kind} ({platform}), peak bf16 "
        f"{peak_tflops(device.device_kind)} TFLOP/s", flush=True)
  summary = {"device": device.device_kind, "platform": platform,
             "command": "python -m experiments.accelerator_check " + " ".join(argv or sys.argv[1:])}
  if platform == "cpu" and not args.quick:
    print("accelerator_check: no GPU or TPU here; nothing to check (--quick runs tiny sizes on CPU)")
    return 0
  summary["backends"] = check_backends(platform, shapes, patterns)
  for r in summary["backends"]:
    print(f"  {r['pattern']:<24}{r['impl']:>7}{r['dtype']:>9}{str(r['shape']):>20}"
          f"{r['o']:>10.1e}{r['lse']:>10.1e}{r['grads']:>10.1e}"
          + ("  (fell back to xla)" if r["fell_back"] else "") + ("" if r["ok"] else "  FAIL"))
  deadline = start + args.budget_seconds
  rows = []
  for T in map(int, args.seq_lens.split(",")):
    for name, spec in MODELS:
      rows.append(time_model(name, spec, T, args, deadline))
      print(f"  {name} T={T}: " + (f"{rows[-1]['tokens_per_sec']:,.0f} tokens/s"
                                   if "tokens_per_sec" in rows[-1] else
                                   rows[-1].get("error", rows[-1].get("skipped", ""))), flush=True)
  dense = {r["seq_len"]: r.get("tokens_per_sec") for r in rows if r["model"] == "dense"}
  for r in rows:
    if r.get("tokens_per_sec") and dense.get(r["seq_len"]) and r["model"] != "dense":
      r["vs_dense"] = r["tokens_per_sec"] / dense[r["seq_len"]]
  summary["train_steps"] = rows
  summary["seconds"] = time.time() - start
  failures = sum(not r["ok"] for r in summary["backends"])
  summary["backend_failures"] = failures
  out = args.out or os.path.join(REPO, "experiments", "results",
                                 f"accelerator_check_{platform}{'_quick' if args.quick else ''}.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(summary, f, indent=1)
  print(f"\n{'model':<16}{'T':>8}{'tokens/s':>12}{'x dense':>9}{'MFU':>8}{'est GiB':>9}{'peak GiB':>9}")
  for r in rows:
    if "tokens_per_sec" not in r:
      print(f"{r['model']:<16}{r['seq_len']:>8}  {r.get('error', r.get('skipped'))}")
      continue
    gib = lambda b: f"{b / 2**30:>9.2f}" if b else f"{'-':>9}"
    print(f"{r['model']:<16}{r['seq_len']:>8}{r['tokens_per_sec']:>12,.0f}"
          f"{r.get('vs_dense', float('nan')):>9.2f}"
          + (f"{r['mfu']:>8.1%}" if r.get("mfu") is not None else f"{'-':>8}")
          + gib(r["estimate_bytes"]) + gib(r["peak_bytes_in_use"]))
  print(f"\naccelerator_check done in {summary['seconds']:.0f} s; backend failures: {failures}; "
        f"summary in {out}")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
