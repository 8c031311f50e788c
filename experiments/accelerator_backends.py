"""The device check's attention rows: each backend against a float32 masked reference.

`backend_rows`: `core.attend` on every backend the platform runs (`auto`'s kernel and `xla`;
on CPU the kernels interpreted), float32 and bfloat16, values, lse and the gradients of q, k, v
and the priors under cotangents on o and lse, for dense causal, a sliding window, blocks with
lookback and π.

`cudnn_rows`: the calls the models make where cuDNN serves them (dense causal and a sliding
window through `ops.attention`, no log-sum-exp, start 0, bfloat16, also under remat): o and
the gradients of q, k, v under a cotangent on o. On a GPU a row passes only if it matches and
its compiled forward + backward call cuDNN. On CPU the same calls run interpreted (on the
Pallas kernel: cuDNN cannot be interpreted), and `cudnn_aot_rows` compiles them for an H200
where the CUDA plugin is installed, counting cuDNN's calls.

Each row: its settings, the errors (max |a - b| / max |b|), `kernels` (the attention kernels'
custom calls in the compiled module by kind, `step_memory.kernel_kinds`), `ok`, `seconds`.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from efficient_lm.ops import attention, core, priors
from efficient_lm.ops.core import backends
from efficient_lm.ops.pattern import Pattern
from efficient_lm.training.step_memory import kernel_kinds

TOLERANCE = {"float32": 2e-4, "bfloat16": 3e-2}  # values; gradients: 5x


def patterns_for(quick: bool) -> dict:
  if quick:
    return {"sliding(32)": Pattern.sliding(32), "pi(16, 32, 3 skips)": Pattern.pi(16, 32, 3)}
  return {"dense causal": Pattern.dense(), "sliding(256)": Pattern.sliding(256),
          "blocks(128, lookback 1)": Pattern.blocks(128, 1),
          "pi(128, 256, 3 skips)": Pattern.pi(128, 256, 3)}


def shapes_for(quick: bool) -> list:
  return [(1, 96, 2, 16)] if quick else [(2, 1024, 4, 64), (1, 2048, 8, 128), (1, 1000, 2, 64)]


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def _run(fn, args, loss_of):
  """Compiles value-and-grad of `loss_of(fn(*args))` in the non-None args; (outputs, grads,
  kernel counts)."""
  argnums = tuple(i for i, a in enumerate(args) if a is not None)
  step = jax.jit(jax.value_and_grad(lambda *a: loss_of(fn(*a)), argnums=argnums, has_aux=True))
  compiled = step.lower(*args).compile()
  (_, out), grads = compiled(*args)
  return out, grads, kernel_kinds(compiled.as_text())


def _inputs(shape, dtype, skips: bool, seed: int):
  B, T, H, K = shape
  keys = jax.random.split(jax.random.key(seed), 6)
  q, k, v = (jax.random.normal(kk, (B, T, H, K), jnp.float32).astype(dtype) for kk in keys[:3])
  lp = sp = None
  if skips:
    lp, sp = priors.gate_priors(gate_logits_BTH=jax.random.normal(keys[3], (B, T, H)))
  return (q, k, v, lp, sp), jax.random.normal(keys[4], (B, T, H, K)), jax.random.normal(keys[5], (B, T, H))


def _off(errors: dict, tol: float) -> list[str]:
  """The errors past tolerance (gradients: 5x), or not finite."""
  return [f"{k} error {v:.1e}" for k, v in errors.items()
          if not np.isfinite(v) or v > (5 * tol if k == "grads" else tol)]


def _guarded(row: dict, measure) -> dict:
  """`row` with what `measure()` -> (fields, problems) found, `ok` and `seconds`; an exception
  is the row's one problem (the next row still runs)."""
  start = time.perf_counter()
  try:
    fields, problems = measure()
  except Exception as error:  # pylint: disable=broad-except
    text = str(error).strip()
    fields, problems = {}, [f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"]
  return {**row, **fields, "ok": not problems, "problems": problems,
          "seconds": time.perf_counter() - start}


def _f32(args):
  return tuple(None if a is None else a.astype(jnp.float32) for a in args)


def backend_rows(platform: str, quick: bool, emit) -> None:
  """`emit(row)` for each backend x dtype x pattern x shape."""
  kernel = backends.resolve("auto", platform)
  interpret = platform == "cpu"
  impls = sorted({"xla", kernel} | ({"gpu", "splash"} if interpret else set()))
  with jax.default_matmul_precision("highest"):
    for dtype in (jnp.float32, jnp.bfloat16):
      name_of_dtype = jnp.dtype(dtype).name
      tol = TOLERANCE[name_of_dtype]
      for name, pattern in patterns_for(quick).items():
        for shape in shapes_for(quick):
          args, cot_o, cot_lse = _inputs(shape, dtype, pattern.has_skips, seed=shape[1] + shape[2])
          loss_of = lambda out, cot_o=cot_o, cot_lse=cot_lse: (
              jnp.sum(out[0].astype(jnp.float32) * cot_o) + jnp.sum(out[1] * cot_lse), out)
          want = {}
          for impl in impls:
            row = {"pattern": name, "impl": impl, "interpret": interpret and impl != "xla",
                   "dtype": name_of_dtype, "shape": list(shape)}

            def measure(pattern=pattern, impl=impl, args=args, loss_of=loss_of, tol=tol):
              if not want:
                reference = lambda q, k, v, lp, sp: core.attend(
                    q, k, v, pattern, local_prior=lp, skip_prior=sp, impl="reference")
                want["o"], want["grads"], _ = _run(reference, _f32(args), loss_of)
              fast = lambda q, k, v, lp, sp: core.attend(
                  q, k, v, pattern, local_prior=lp, skip_prior=sp, impl=impl,
                  interpret=interpret and impl in ("gpu", "splash"))
              fallbacks = sum(core.FALLBACKS.values())
              (o, lse), grads, kernels = _run(fast, args, loss_of)
              (ro, rlse), rgrads = want["o"], want["grads"]
              errors = {"o": _rel(o, ro), "lse": _rel(lse, rlse),
                        "grads": max(_rel(a, b) for a, b in zip(grads, rgrads))}
              problems = _off(errors, tol)
              if impl == kernel and not interpret and not any(kernels.values()):
                problems.append(f"no {impl} kernel in the compiled module")
              return {**errors, "kernels": kernels,
                      "fell_back": sum(core.FALLBACKS.values()) > fallbacks}, problems

            emit(_guarded(row, measure))


CUDNN_CALLS = {  # name -> (the model's op on q, k, v, remat)
    "dense causal": (lambda impl, interpret: lambda q, k, v: attention.causal_attention(
        q, k, v, impl=impl, interpret=interpret), False),
    "sliding(256)": (lambda impl, interpret: lambda q, k, v: attention.sliding_window_attention(
        q, k, v, window=256, impl=impl, interpret=interpret), False),
    "sliding(256), remat": (lambda impl, interpret: lambda q, k, v: attention.sliding_window_attention(
        q, k, v, window=256, impl=impl, interpret=interpret), True),
}
CUDNN_PATTERNS = {"dense causal": Pattern.dense(), "sliding(256)": Pattern.sliding(256),
                  "sliding(256), remat": Pattern.sliding(256)}


def cudnn_shapes(quick: bool) -> list:
  return [(1, 128, 2, 64)] if quick else [(2, 2048, 8, 64), (1, 4096, 8, 128)]


def cudnn_rows(platform: str, quick: bool, emit) -> None:
  """`emit(row)` for each model call cuDNN serves x shape (bfloat16)."""
  interpret = platform != "gpu"
  with jax.default_matmul_precision("highest"):
    for name, (make, remat) in CUDNN_CALLS.items():
      for shape in cudnn_shapes(quick):
        row = {"call": name, "shape": list(shape), "dtype": "bfloat16",
               "path": "pallas, interpreted" if interpret else "cudnn"}

        def measure(name=name, make=make, remat=remat, shape=shape):
          (q, k, v, _, _), cot_o, _ = _inputs(shape, jnp.bfloat16, False, seed=shape[1] + 7)
          loss_of = lambda o: (jnp.sum(o.astype(jnp.float32) * cot_o), o)
          fn = make("gpu", interpret)
          o, grads, kernels = _run(jax.checkpoint(fn) if remat else fn, (q, k, v), loss_of)
          pattern = CUDNN_PATTERNS[name]
          reference = lambda q, k, v: core.attend(q, k, v, pattern, impl="reference")[0]
          ro, rgrads, _ = _run(reference, _f32((q, k, v)), loss_of)
          errors = {"o": _rel(o, ro), "grads": max(_rel(a, b) for a, b in zip(grads, rgrads))}
          problems = _off(errors, TOLERANCE["bfloat16"])
          if not interpret and kernels["cudnn"] < 2:
            problems.append(f"cuDNN did not serve the call (kernels: {kernels})")
          return {**errors, "kernels": kernels}, problems

        emit(_guarded(row, measure))


def cudnn_aot_rows(quick: bool, emit) -> None:
  """`emit(row)` for each call of `cudnn_rows` compiled (not run) for an H200 from this host:
  the cuDNN custom calls its forward + backward hold. One row saying why when the CUDA plugin
  is missing."""
  from efficient_lm.parallel import targets  # pylint: disable=import-outside-toplevel
  try:
    target = targets.load("gpu:h200:1x1x1")
  except targets.TargetError as error:
    emit({"call": "all", "aot": "gpu:h200:1x1x1", "skipped": str(error).splitlines()[0],
          "ok": True, "problems": []})
    return
  mesh = jax.sharding.Mesh(np.array(target.devices), ("data",))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  for name, (make, remat) in CUDNN_CALLS.items():
    for shape in cudnn_shapes(quick):

      def measure(make=make, remat=remat, shape=shape):
        fn = make("gpu", False)
        fn = jax.checkpoint(fn) if remat else fn
        grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
        spec = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=whole)
        with jax.set_mesh(mesh):
          kernels = kernel_kinds(jax.jit(grad).lower(spec, spec, spec).compile().as_text())
        return {"kernels": kernels}, ([] if kernels["cudnn"] >= 2 else
                                      [f"cuDNN did not serve the call (kernels: {kernels})"])

      emit(_guarded({"call": name, "shape": list(shape), "aot": target.spec}, measure))
