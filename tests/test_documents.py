"""Documents never leak into each other: document ids (`segment_ids`) in the core, every backend,
the ring, every family, every mode (whole sequence, sequence chunks, context parallelism,
decoding), and the data that emits them.

The core is compared with a dense masked reference whose masks are the pattern's definition and
the ids' equality, one position pair at a time; the models by perturbation: with two documents A
then B in a sequence, replacing A's tokens leaves B's logits unchanged (and without the ids they
change, so the check can fail).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import fast_first
from efficient_lm import data
from efficient_lm import models
from efficient_lm.ops import attention
from efficient_lm.ops import core
from efficient_lm.ops import memory
from efficient_lm.ops import ring
from efficient_lm.ops.pattern import Pattern
from test_core import random_inputs, reference_attend, reference_masks, value_and_grads
from test_data import corpus, corpus_dir  # noqa: F401  (fixtures)
from test_models import tiny_model_config

KERNELS = ("splash", "gpu")


def random_documents(B: int, T: int, seed: int, count: int = 3) -> np.ndarray:
  """`[B, T]` ids of `count` contiguous documents per row at random boundaries."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((B, T), np.int32)
  for b in range(B):
    for cut in np.sort(rng.choice(np.arange(1, T), size=count - 1, replace=False)):
      ids[b, cut:] += 1
  return ids


# The core on every backend against the reference.

PATTERNS = [Pattern.dense(), Pattern.sliding(5), Pattern.pi(3, 5, 3), Pattern.blocks(4, 1),
            Pattern.segments(6)]


@pytest.mark.parametrize("impl", fast_first(["xla", *KERNELS]))
@pytest.mark.parametrize("pattern", fast_first(PATTERNS, keep=(0, 2)), ids=str)
def test_core_keeps_queries_in_their_documents(impl, pattern):
  """Values and every gradient (q, k, v, priors, under o and lse cotangents) equal the dense
  masked reference whose masks also require equal document ids."""
  T = 24
  priors = (pattern.has_skips,) * 2
  args, cotangents = random_inputs(T, T, seed=3, priors=priors)
  ids = jnp.asarray(random_documents(2, T, seed=4))
  local, skip = reference_masks(pattern, np.arange(T), np.arange(T))
  same = np.asarray(ids)[:, None, :, None] == np.asarray(ids)[:, None, None, :]
  fast = lambda q, k, v, lp, sp: core.attend(q, k, v, pattern, local_prior=lp, skip_prior=sp,
                                             q_segments=ids, k_segments=ids, impl=impl,
                                             interpret=impl != "xla")
  slow = lambda q, k, v, lp, sp: reference_attend(q, k, v, local & same, skip & same, lp, sp)
  (o, lse), grads = jax.jit(lambda *a: value_and_grads(fast, a, cotangents))(*args)
  (ro, rlse), rgrads = jax.jit(lambda *a: value_and_grads(slow, a, cotangents))(*args)
  np.testing.assert_allclose(o, ro, atol=2e-5)
  np.testing.assert_allclose(lse, rlse, atol=2e-5)
  for g, rg in zip(grads, rgrads):
    np.testing.assert_allclose(g, rg, atol=2e-4)
  unmasked = core.attend(*args[:3], pattern, local_prior=args[3], skip_prior=args[4])[0]
  assert not np.allclose(unmasked, o, atol=1e-3)  # the documents changed the result


@pytest.mark.parametrize("impl", fast_first(["xla", *KERNELS], keep=(0,)))
def test_a_chunk_and_a_cache_keep_their_documents(impl):
  """A chunk at a traced start over its key window (static offset), and a decoding cache with
  explicit slot positions, take separate query and key ids."""
  T, C, halo = 32, 8, 5
  pattern = Pattern.sliding(6)
  (q, k, v, _, _), _ = random_inputs(T, T, seed=5)
  ids = jnp.asarray(random_documents(2, T, seed=6))
  whole = core.attend(q, k, v, pattern, q_segments=ids, k_segments=ids, impl="reference")[0]

  @jax.jit
  def chunk(start):
    window = lambda x: jax.lax.dynamic_slice_in_dim(x, start - halo, C + halo, axis=1)
    return core.attend(jax.lax.dynamic_slice_in_dim(q, start, C, axis=1), window(k), window(v),
                       pattern, q_start=start, k_offset=-halo, q_align=C,
                       q_segments=jax.lax.dynamic_slice_in_dim(ids, start, C, axis=1),
                       k_segments=window(ids), impl=impl, interpret=impl != "xla")[0]

  for start in (8, 16, 24):
    np.testing.assert_allclose(chunk(start), whole[:, start:start + C], atol=2e-5)
  slots = jnp.asarray(np.r_[np.arange(10, 16), -np.ones(2, int)], jnp.int32)  # 2 empty slots
  kk, vv = k[:, 10:18], v[:, 10:18]
  cached = core.attend(q[:, 14:16], kk, vv, pattern, q_start=14, k_positions=slots,
                       q_segments=ids[:, 14:16], k_segments=ids[:, 10:18], impl=impl,
                       interpret=impl != "xla")[0]
  np.testing.assert_allclose(cached, whole[:, 14:16], atol=2e-5)


# The ring: document ids travel with the keys.

def mesh_of(data_devices: int, context: int) -> jax.sharding.Mesh:
  return jax.make_mesh((data_devices, context), ("data", "context"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:data_devices * context])


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize("impl", fast_first(["xla", *KERNELS], keep=(0, 2)))
@pytest.mark.parametrize("op, layout", fast_first([
    ("causal", "natural"), ("causal", "zigzag"), ("pi", "natural"), ("blocks", "natural")],
    keep=(1, 2)))
def test_ring_with_documents_equals_one_device(impl, op, layout):
  """Each ring (halo or rotation) on each backend equals the single-device op with the same
  document ids, values and gradients, and no kernel call falls back to the XLA core."""
  T, n = 32, 4
  (q, k, v, _, _), _ = random_inputs(T, T, seed=7)
  gate = jax.nn.sigmoid(jax.random.normal(jax.random.key(8), (2, T, 2)))
  ids = jnp.asarray(random_documents(2, T, seed=9))
  to = lambda x: ring.to_layout(x, n, layout)
  back = lambda x: ring.from_layout(x, n, layout)
  kw = dict(impl=impl, interpret=impl != "xla")
  ops = {"causal": lambda q, k, v, g, s, **a: attention.causal_attention(q, k, v, segment_ids=s, **a),
         "pi": lambda q, k, v, g, s, **a: attention.pi_attention(
             q, k, v, g, window=3, period=5, num_skips=3, segment_ids=s, **a),
         "blocks": lambda q, k, v, g, s, **a: attention.block_local_attention(
             q, k, v, block_size=4, lookback=1, segment_ids=s, **a)}
  extra = {"layout": layout} if op == "causal" else {}
  sharded = lambda q, k, v, g: back(ops[op](to(q), to(k), to(v), to(g), to(ids),
                                            mesh=mesh_of(2, n), **extra, **kw))
  single = lambda q, k, v, g: ops[op](q, k, v, g, ids)
  cotangent = jax.random.normal(jax.random.key(10), q.shape)
  fallbacks = sum(core.FALLBACKS.values())
  grad = lambda f: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * cotangent),
                                              argnums=(0, 1, 2, 3)))(q, k, v, gate)
  (got, got_grads), (want, want_grads) = grad(sharded), grad(single)
  assert sum(core.FALLBACKS.values()) == fallbacks, core.FALLBACKS
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, w, atol=1e-4)


def test_exponential_memory_restarts():
  """keep = 0 at a block drops the state before it: the memory there is the blocks from it on
  (both forms), and the other rows' memory is untouched."""
  s = jax.random.normal(jax.random.key(11), (2, 7, 3))
  keep = jnp.asarray([[1, 1, 1, 0, 1, 1, 1], [1] * 7], jnp.float32)
  for fn in (memory.exponential_memory, memory.exponential_memory_parallel):
    m = fn(s, 0.8, keep)
    np.testing.assert_allclose(m[0, 3:], memory.exponential_memory(s[:1, 3:], 0.8)[0], atol=1e-6)
    np.testing.assert_allclose(m[0, :3], memory.exponential_memory(s[:1, :3], 0.8)[0], atol=1e-6)
    np.testing.assert_allclose(m[1], memory.exponential_memory(s[1:], 0.8)[0], atol=1e-6)


# Every family: B's logits do not move when A's tokens do.

FAMILIES = sorted(models.REGISTRY)
PARALLEL = [name for name in FAMILIES if models.REGISTRY[name].context_parallel]


def perturbed_logits(cfg, mesh=None, ids=True, cut=11):
  """(B's logits, B's logits after A's tokens are replaced) for documents A = [0, cut), B after."""
  model = models.create(cfg, rngs=nnx.Rngs(0), mesh=mesh)
  T = cfg.seq_len
  tokens = jax.random.randint(jax.random.key(1), (2, T), 0, cfg.vocab_size)
  other = tokens.at[:, :cut].set(jax.random.randint(jax.random.key(2), (2, cut), 0, cfg.vocab_size))
  segment_ids = jnp.broadcast_to((jnp.arange(T) >= cut).astype(jnp.int32), (2, T))
  positions = None
  layout = models.sequence_layout(cfg, mesh)
  if mesh is not None and layout != "natural":
    n = models.context_size(mesh)
    tokens, other, segment_ids = (ring.to_layout(x, n, layout) for x in (tokens, other, segment_ids))
    positions = jnp.broadcast_to(jnp.asarray(ring.layout_positions(T, n, layout)), (2, T))

  graphdef, state = nnx.split(model)

  @jax.jit
  def logits(state, tokens):
    out = nnx.merge(graphdef, state)(tokens, positions_BT=positions,
                                     segment_ids_BT=segment_ids if ids else None)
    if positions is not None:
      out = ring.from_layout(out, models.context_size(mesh), layout)
    return out[:, max(0, cut - (T - out.shape[1])):]  # B's positions among those predicted

  return logits(state, tokens), logits(state, other)


MODES = {"xla": {}, "splash": dict(attention_impl="splash", kernel_interpret=True),
         "gpu": dict(attention_impl="gpu", kernel_interpret=True)}


@pytest.mark.parametrize("mode", fast_first(list(MODES), keep=(0,)))
@pytest.mark.parametrize("name", fast_first(FAMILIES, keep=(FAMILIES.index("bcmt"),
                                                              FAMILIES.index("pi_attention"),
                                                              FAMILIES.index("perceiver_ar"))))
def test_documents_do_not_leak_whole_sequence(name, mode):
  cfg = tiny_model_config(name, **MODES[mode])
  got, got_other = perturbed_logits(cfg)
  assert float(jnp.max(jnp.abs(got - got_other))) <= 1e-5
  leaked, leaked_other = perturbed_logits(cfg, ids=False)
  assert float(jnp.max(jnp.abs(leaked - leaked_other))) > 1e-3  # without ids A reaches B


@pytest.mark.parametrize("mode", fast_first(list(MODES), keep=(0,)))
@pytest.mark.parametrize("name", fast_first([n for n in FAMILIES if n in PARALLEL and n != "dense"],
                                            keep=(0,)))
def test_documents_do_not_leak_in_sequence_chunks(name, mode):
  cfg = tiny_model_config(name, seq_chunk=16, **MODES[mode])
  got, got_other = perturbed_logits(cfg, cut=19)  # the boundary inside the second chunk
  assert float(jnp.max(jnp.abs(got - got_other))) <= 1e-5


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize("mode", fast_first(list(MODES), keep=(0,)))
@pytest.mark.parametrize("name", fast_first(PARALLEL, keep=(PARALLEL.index("dense"),
                                                            PARALLEL.index("bcmt"))))
def test_documents_do_not_leak_with_context_parallelism(name, mode):
  cfg = tiny_model_config(name, **MODES[mode])
  got, got_other = perturbed_logits(cfg, mesh=mesh_of(1, 2), cut=19)
  assert float(jnp.max(jnp.abs(got - got_other))) <= 1e-5
  whole, _ = perturbed_logits(tiny_model_config(name, **MODES[mode]), cut=19)
  np.testing.assert_allclose(got, whole, atol=2e-5)  # and the sharded model is the same model


# Decoding keeps the documents too: the cached logits equal the full pass with the same ids.

# (prompt length P, total length N): Perceiver-AR's history is fixed at prefill (P - Z tokens;
# the compressed variant prefills exactly seq_len = 32), every later token is a latent.
PROMPTS = {"compressed_double_attention": (32, 40)}


@pytest.mark.parametrize("name", fast_first(FAMILIES, keep=(FAMILIES.index("bcmt"),
                                                              FAMILIES.index("dense"))))
def test_decoding_with_documents_equals_the_full_pass(name):
  """A prompt's prefill, then one token at a time, with three documents: the logits of the full
  pass with the same ids (for Perceiver-AR, with the prompt's history and every later token a
  latent)."""
  cfg = tiny_model_config(name, block_size=4) if name in ("bcmt", "honly") else tiny_model_config(name)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  P, N = PROMPTS.get(name, (20, 40))
  tokens = jax.random.randint(jax.random.key(3), (2, N), 0, cfg.vocab_size)
  ids = jnp.asarray(random_documents(2, N, seed=12, count=4))
  Z = getattr(model, "num_latents", None)
  if Z is not None:  # the reference: one pass whose latents start where the prompt's history ends
    model.num_latents = N - (P - min(Z, P))
  graphdef, state = nnx.split(model)
  full = jax.jit(lambda s, t, i: nnx.merge(graphdef, s)(t, segment_ids_BT=i))(state, tokens, ids)
  if Z is not None:
    model.num_latents = Z
    graphdef, state = nnx.split(model)
  prefill = jax.jit(lambda s, t, i: nnx.merge(graphdef, s).prefill(
      t, nnx.merge(graphdef, s).init_cache(2, N), i))
  logits, cache = prefill(state, tokens[:, :P], ids[:, :P])
  step = jax.jit(lambda s, t, c, p, i: nnx.merge(graphdef, s).decode_step(t, c, p, i))
  steps = [logits[:, -1]]
  for p in range(P, N - 1):
    out, cache = step(state, tokens[:, p], cache, p, ids[:, p])
    steps.append(out)
  np.testing.assert_allclose(jnp.stack(steps, axis=1), full[:, -(N - P + 1):-1], atol=1e-4)


# The data.

def test_document_ids_open_at_each_end_of_document_token():
  inputs = np.array([[5, 0, 7, 8, 0, 0, 9], [0, 3, 4, 0, 1, 2, 2]])
  np.testing.assert_array_equal(data.document_ids(inputs, eos_id=0),
                                [[0, 1, 1, 1, 2, 3, 3], [1, 1, 1, 2, 2, 2, 2]])


def test_corpus_batches_carry_document_ids(corpus):
  """Training and evaluation batches carry the ids of their inputs when document_mask is on."""
  eos = corpus.tokenizer.eos_id
  corpus.document_mask = True
  batch = next(corpus.train_iterator(batch_size=2, seed=0, seq_len=64))
  np.testing.assert_array_equal(batch["segment_ids"], data.document_ids(batch["inputs"], eos))
  first = next(iter(corpus.eval_batches("validation", batch_size=2, seq_len=64)))
  np.testing.assert_array_equal(first["segment_ids"], data.document_ids(first["inputs"], eos))
  corpus.document_mask = False
  assert "segment_ids" not in next(corpus.train_iterator(batch_size=2, seed=0, seq_len=64))


@pytest.mark.parametrize("name", fast_first(FAMILIES, keep=(FAMILIES.index("ecp"),)))
def test_training_with_documents_runs_for_every_family(name):
  """A batch with document ids through the train step: the loss is finite and falls on a batch
  seen again, and it differs from the same batch without ids (the ids are used)."""
  import optax  # pylint: disable=import-outside-toplevel
  from efficient_lm.training import step as train_step  # pylint: disable=import-outside-toplevel
  from efficient_lm.state.train_state import TrainState  # pylint: disable=import-outside-toplevel
  cfg = tiny_model_config(name)
  graphdef, params = nnx.split(models.create(cfg, rngs=nnx.Rngs(0)))
  tx = optax.adam(1e-2)
  step = train_step.make_train_step(graphdef, tx, lambda s: 1e-2, seed=0)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, cfg.vocab_size, (2, cfg.seq_len + 1)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "weights": np.ones((2, cfg.seq_len), np.float32),
           "segment_ids": random_documents(2, cfg.seq_len, seed=13)}
  fresh = lambda: TrainState(step=jnp.zeros((), jnp.int32), params=jax.tree.map(jnp.copy, params),
                             opt_state=tx.init(params))  # the step donates its state
  state, losses = fresh(), []
  for _ in range(3):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  _, without = step(fresh(), {k: v for k, v in batch.items() if k != "segment_ids"})
  assert abs(float(without["loss"]) - losses[0]) > 1e-6
