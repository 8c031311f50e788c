"""Every route from a kernel request to the XLA core is counted in `FALLBACKS` with its reason.

The walk: each kernel `impl` x mode (forward, gradient, a ring step's backward at a given o and
lse, a decoding cache's explicit positions, traced starts, a chunk at a traced start with a static
key offset) x pattern kind, traced abstractly (`jax.eval_shape`: routing is decided at trace time,
nothing compiles). The XLA backend is wrapped to count the calls it is handed; every one of them
must be a `FALLBACKS` entry of the requested kernel, with a reason, logged once. Also: a requested
kernel the installed jax cannot call is refused at validation (`auto` warns), and the generation
report (`backends.trace_record`, `report_line`) names kernels and fallbacks.
"""

import collections
import dataclasses
import logging

import jax
import jax.numpy as jnp
import pytest

from efficient_lm import models
from efficient_lm.config.errors import ConfigError
from efficient_lm.ops import core
from efficient_lm.ops.core import backends
from efficient_lm.ops.core import xla
from efficient_lm.ops.pattern import Pattern
from efficient_lm.runtime import jax_compat
from test_models import tiny_model_config

KERNELS = ("splash", "gpu")
PATTERNS = [Pattern.dense(), Pattern.sliding(5), Pattern.blocks(4, 1), Pattern.segments(4),
            Pattern.pi(3, 5, 3)]
MODES = ("forward", "gradient", "ring_backward", "explicit_positions", "traced_starts",
         "chunk_at_traced_start")
# The modes a kernel cannot run for any pattern: each must show up as a fallback.
ALWAYS_XLA = {"explicit_positions", "traced_starts"}
T = 16


@pytest.fixture
def xla_calls(monkeypatch):
  """A Counter of the calls the XLA backend is handed ('attend', 'backward'), fresh FALLBACKS."""
  calls = collections.Counter()
  real = xla.BACKEND

  def counted(name, fn):
    def wrapper(*args, **kwargs):
      calls[name] += 1
      return fn(*args, **kwargs)
    return wrapper

  monkeypatch.setattr(xla, "BACKEND", dataclasses.replace(
      real, attend=counted("attend", real.attend), backward=counted("backward", real.backward)))
  monkeypatch.setattr(backends, "FALLBACKS", collections.Counter())
  return calls


def run_mode(mode: str, impl: str, pattern: Pattern):
  """Traces one call of `mode` (abstractly) asking for `impl`."""
  shape = jax.ShapeDtypeStruct((1, T, 2, 8), jnp.float32)
  rows = jax.ShapeDtypeStruct((1, T, 2), jnp.float32)
  priors = pattern.has_skips
  kw = dict(impl=impl, interpret=True)

  def attend(q, k, v, lp, sp, **extra):
    return core.attend(q, k, v, pattern, local_prior=lp if priors else None,
                       skip_prior=sp if priors else None, **kw, **extra)

  if mode == "forward":
    fn = lambda q, k, v, lp, sp: attend(q, k, v, lp, sp)
  elif mode == "gradient":
    fn = jax.grad(lambda q, k, v, lp, sp: jnp.sum(attend(q, k, v, lp, sp)[0]), argnums=(0, 1, 2))
  elif mode == "ring_backward":
    def fn(q, k, v, lp, sp):
      o, lse = attend(q, k, v, lp, sp, q_start=T, k_start=0)
      return core.attend_backward(q, k, v, pattern, o, lse, o, q_start=T, k_start=0,
                                  local_prior=lp if priors else None,
                                  skip_prior=sp if priors else None, **kw)
  elif mode == "explicit_positions":
    fn = lambda q, k, v, lp, sp: attend(q, k, v, lp, sp, q_start=T - 1,
                                        k_positions=jnp.arange(T, dtype=jnp.int32))
  elif mode == "traced_starts":
    fn = lambda q, k, v, lp, sp, s: attend(q, k, v, lp, sp, q_start=s, k_start=s - 4)
    return jax.eval_shape(fn, shape, shape, shape, rows, rows, jax.ShapeDtypeStruct((), jnp.int32))
  elif mode == "chunk_at_traced_start":
    fn = lambda q, k, v, lp, sp, s: attend(q, k, v, lp, sp, q_start=s, k_offset=0, q_align=T)
    return jax.eval_shape(fn, shape, shape, shape, rows, rows, jax.ShapeDtypeStruct((), jnp.int32))
  return jax.eval_shape(fn, shape, shape, shape, rows, rows)


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("mode", MODES)
def test_every_route_to_xla_is_a_counted_fallback(impl, mode, xla_calls, caplog):
  caplog.set_level(logging.INFO, logger=backends.__name__)
  for pattern in PATTERNS:
    before, logged = sum(xla_calls.values()), len(caplog.records)
    fallbacks = sum(backends.FALLBACKS.values())
    run_mode(mode, impl, pattern)
    routed = sum(xla_calls.values()) - before
    counted = sum(backends.FALLBACKS.values()) - fallbacks
    assert routed == counted, (pattern, dict(xla_calls), dict(backends.FALLBACKS))
    if mode in ALWAYS_XLA:
      assert routed > 0, pattern
    if mode == "ring_backward" and pattern.has_skips:  # the kernel's backward takes no skips
      assert xla_calls["backward"] > 0
  for (name, reason), n in backends.FALLBACKS.items():
    assert name == impl and reason and "\n" not in reason and n > 0
  lines = [r.getMessage() for r in caplog.records if "instead of" in r.getMessage()]
  assert len(lines) == len(backends.FALLBACKS)  # one line per reason, however many calls
  assert sorted(lines) == sorted(f"attention on xla instead of {impl} for this call: {reason}"
                                 for _, reason in backends.FALLBACKS)


def test_a_broken_route_would_be_caught(xla_calls, monkeypatch):
  """The walk's check can fail: a backend that quietly runs xla (no `fallback`) is caught."""
  splash = backends.get("splash")
  quiet = dataclasses.replace(splash, attend=lambda call, *a, **k: xla.BACKEND.attend(call, *a, **k))
  monkeypatch.setattr(backends, "get", lambda name: quiet if name == "splash" else
                      __import__(f"efficient_lm.ops.core.{backends.canonical(name)}",
                                 fromlist=["BACKEND"]).BACKEND)
  run_mode("forward", "splash", Pattern.sliding(5))
  assert xla_calls["attend"] == 1 and sum(backends.FALLBACKS.values()) == 0


def test_a_kernel_this_jax_cannot_call_is_refused_at_validation(monkeypatch, caplog):
  reason = "jax 9.9: _splash_attention_forward is absent"
  monkeypatch.setattr(jax_compat, "splash_missing", lambda: reason)
  monkeypatch.setattr(backends, "_WARNED", set())
  cfg = tiny_model_config("pi_attention", attention_impl="splash")
  with pytest.raises(ConfigError, match="model.attention_impl='splash' cannot call its kernels "
                     "on this jax.*_splash_attention_forward is absent.*'xla'"):
    models.validate_attention_impl(cfg, "tpu")
  caplog.set_level(logging.WARNING, logger=backends.__name__)
  cfg = dataclasses.replace(cfg, attention_impl="auto")
  models.validate_attention_impl(cfg, "tpu")
  models.validate_attention_impl(cfg, "tpu")
  warnings = [r.getMessage() for r in caplog.records if reason in r.getMessage()]
  assert len(warnings) == 1 and "every attention call runs on xla" in warnings[0]
  models.validate_attention_impl(cfg, "cpu")  # auto is xla there: nothing to say
  monkeypatch.setattr(jax_compat, "splash_missing", lambda: None)
  cfg = dataclasses.replace(cfg, attention_impl="splash")
  models.validate_attention_impl(cfg, "tpu")


def test_generation_report_names_kernels_and_fallbacks(monkeypatch):
  """A whole-prompt prefill runs on the kernel; a cached step (explicit positions) on xla."""
  monkeypatch.setattr(backends, "FALLBACKS", collections.Counter())
  pattern = Pattern.sliding(5)
  x = jax.ShapeDtypeStruct((1, T, 2, 8), jnp.float32)
  one = jax.ShapeDtypeStruct((1, 1, 2, 8), jnp.float32)
  prefill = lambda q, k, v: core.attend(q, k, v, pattern, impl="splash", interpret=True)
  step = lambda q, k, v: core.attend(q, k, v, pattern, q_start=T - 1, impl="splash",
                                     interpret=True, k_positions=jnp.arange(T, dtype=jnp.int32))
  first = backends.trace_record(prefill, x, x, x)
  assert sum(first["kernel_calls"].values()) == 1 and not first["fallbacks"]
  again = backends.trace_record(prefill, x, x, x)  # a fresh trace each time: the same record
  assert again == first
  second = backends.trace_record(step, one, x, x)
  assert not second["kernel_calls"]
  [(name, reason)] = second["fallbacks"]
  assert name == "splash" and "explicit key positions" in reason
  line = backends.report_line(second, "decode step")
  assert line.startswith("attention (decode step): 0 kernel calls, 1 on xla instead of a kernel")
  assert reason in line
  assert "1 kernel calls (splash: " in backends.report_line(first, "prefill")


def test_a_generation_reports_its_prefill_and_decode_step():
  """`ops.report` on a model asked for splash: the whole-prompt prefill on the kernel, each
  cached step (and a prefill chunk after the first) on xla with the reason, as the docs say."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from efficient_lm.ops import report  # pylint: disable=import-outside-toplevel
  model = models.create(tiny_model_config("pi_attention", attention_impl="splash",
                                          kernel_interpret=True), rngs=nnx.Rngs(0))
  kw = dict(batch=2, prompt_len=20, max_len=40)
  whole = report.generation_records(model, **kw)
  assert sum(whole["prefill"]["kernel_calls"].values()) >= 1 and not whole["prefill"]["fallbacks"]
  step = whole["decode step"]
  assert not step["kernel_calls"] and sum(step["fallbacks"].values()) >= 1
  assert all(name == "splash" and "explicit key positions" in reason
             for name, reason in step["fallbacks"])
  chunked = report.generation_records(model, prefill_chunk=8, **kw)["prefill"]
  assert chunked["kernel_calls"] and chunked["fallbacks"]  # the first chunk, then the cache
  prefill_line, step_line = report.generation_lines(model, **kw)
  assert prefill_line.startswith("attention (prefill): ") and "0 on xla" in prefill_line
  assert step_line.startswith("attention (decode step): 0 kernel calls") and "explicit" in step_line


def test_the_sample_commands_report_stays_within_learned_positions():
  """`prompts_lines` (what `efficient_lm.sample` prints on stderr) sizes its cache within a
  learned position table, where a longer cache is refused."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from efficient_lm.ops import report  # pylint: disable=import-outside-toplevel
  model = models.create(tiny_model_config("dense", position="learned", seq_len=16),
                        rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="exceeds model.seq_len=16"):
    report.generation_lines(model, batch=2, prompt_len=4, max_len=34)
  lines = report.prompts_lines(model, [[5, 6, 7], [5, 6, 7, 8, 9]], num_tokens=30)
  assert [line.split(":")[0] for line in lines] == ["attention (prefill)", "attention (decode step)"]
