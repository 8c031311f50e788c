"""Cached decoding equals the full forward pass for every decoder model; sampling and the CLI.

(The Perceiver-AR family's caches are tested in test_perceiver_decoding.py.)
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import REPO, build, fast_first
from efficient_lm import models
from efficient_lm.cli import sample_command as sample
from efficient_lm.inference import generation
from efficient_lm.training import loop as train
import families
from test_models import FAMILY_FIELDS, tiny_model_config

# Every registered decoder model (`make_mixer`): its family's `DECODING` cases
# (tests/families/), else its `FIELDS`; the dense baseline first.
_CASES = families.decoding()
DECODER_MODELS = sorted(_CASES + [(name, FAMILY_FIELDS[name]) for name in sorted(models.REGISTRY)
                                  if models.REGISTRY[name].make_mixer is not None
                                  and name not in {n for n, _ in _CASES}],
                        key=lambda case: case[0] != "dense")
IDS = [f"{name}-{i}" for i, (name, _) in enumerate(DECODER_MODELS)]
_LAST = {name: i for i, (name, _) in enumerate(DECODER_MODELS)}  # model -> its last case
_FIRST = {name: i for i, (name, _) in reversed(list(enumerate(DECODER_MODELS)))}


def decode_all(model, tokens_BT, *, prompt_len: int, chunk: int):
  """Logits at every position: prefill `prompt_len` tokens, one chunk of `chunk`, then one
  token at a time in a jitted scan."""
  B, T = tokens_BT.shape
  graphdef, params = nnx.split(model)

  @jax.jit
  def run(params, tokens_BT):
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(B, T)
    prompt_BPV, cache = model.prefill(tokens_BT[:, :prompt_len], cache)
    chunk_BCV, cache = model.extend(tokens_BT[:, prompt_len:prompt_len + chunk], cache, prompt_len)

    def body(carry, t):
      params, cache = carry
      logits_BV, cache = nnx.merge(graphdef, params).decode_step(tokens_BT[:, t], cache, t)
      return (params, cache), logits_BV

    _, steps_TBV = jax.lax.scan(body, (params, cache), jnp.arange(prompt_len + chunk, T))
    # The head at the last position only (what generation.prefill asks for): the same logits.
    last_prompt_B1V, cache = model.prefill(tokens_BT[:, :prompt_len], model.init_cache(B, T),
                                           last_only=True)
    last_chunk_B1V, _ = model.extend(tokens_BT[:, prompt_len:prompt_len + chunk], cache,
                                     prompt_len, last_only=True)
    return (jnp.concatenate([prompt_BPV, chunk_BCV, jnp.swapaxes(steps_TBV, 0, 1)], axis=1),
            jnp.concatenate([last_prompt_B1V, last_chunk_B1V], axis=1))

  return run(params, tokens_BT)


@pytest.mark.parametrize("name,fields", fast_first(DECODER_MODELS, keep=(0,)), ids=IDS)
def test_prefill_chunk_and_steps_equal_the_full_pass(name, fields):
  """Across block/segment boundaries and beyond the window: 40 tokens, prompt 13, chunk 5."""
  cfg = tiny_model_config(name, **fields)
  model = models.create(cfg, rngs=nnx.Rngs(3))
  tokens_BT = jax.random.randint(jax.random.key(4), (2, 40), 0, cfg.vocab_size)
  expected_BTV = jax.jit(lambda m, x: m(x))(model, tokens_BT)
  got_BTV, last_B2V = decode_all(model, tokens_BT, prompt_len=13, chunk=5)
  np.testing.assert_allclose(got_BTV, expected_BTV, atol=2e-4, rtol=2e-4)
  assert last_B2V.shape == (2, 2, cfg.vocab_size)
  np.testing.assert_allclose(last_B2V, expected_BTV[:, [12, 17]], atol=2e-4, rtol=2e-4)


@pytest.mark.slow  # 10-16 s a model
@pytest.mark.parametrize("name,fields", [DECODER_MODELS[_FIRST["dense"]],  # pi: its doubling case
                                         DECODER_MODELS[_LAST["pi_attention"]],
                                         DECODER_MODELS[_FIRST["bcmt"]]],
                         ids=["dense", "pi", "bcmt"])
def test_chunked_prefill_equals_one_pass(name, fields):
  cfg = tiny_model_config(name, **fields)
  model = models.create(cfg, rngs=nnx.Rngs(5))
  tokens_BT = jax.random.randint(jax.random.key(6), (1, 29), 0, cfg.vocab_size)
  one_BV, _ = generation.prefill(model, tokens_BT, model.init_cache(1, 29))
  chunked_BV, _ = generation.prefill(model, tokens_BT, model.init_cache(1, 29), chunk=6)
  np.testing.assert_allclose(chunked_BV, one_BV, atol=2e-4, rtol=2e-4)
  np.testing.assert_allclose(one_BV, model(tokens_BT)[:, -1], atol=2e-4, rtol=2e-4)


def cache_bytes(cache) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))


@pytest.mark.parametrize("name,fields", [c for c in DECODER_MODELS if c[0] != "dense"],
                         ids=[i for i, c in zip(IDS, DECODER_MODELS) if c[0] != "dense"])
def test_efficient_caches_do_not_grow_with_the_context(name, fields):
  cfg = tiny_model_config(name, **fields)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  longest = cfg.seq_len if cfg.position == "learned" else 65536  # learned positions end at seq_len
  short = min(64, longest // 2)  # two different contexts, both past the window (bcmt-7: 20 and 40)
  assert short < longest
  assert cache_bytes(model.init_cache(1, short)) == cache_bytes(model.init_cache(1, longest))


def test_dense_cache_holds_every_token():
  model = models.create(tiny_model_config("dense"), rngs=nnx.Rngs(0))
  assert cache_bytes(model.init_cache(1, 2048)) > 30 * cache_bytes(model.init_cache(1, 64))


def test_pi_cache_span_follows_the_layer_period():
  cfg = tiny_model_config("pi_attention", window=4, period=8, num_skips=2,
                          period_schedule="doubling", num_layers=3)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  cache = model.init_cache(1, 1000)
  # Layer periods 8, 16, 32: the farthest skip is 2 * period back; k and v per layer.
  assert [(c["k"].shape[1], c["v"].shape[1]) for c in cache] == [(17, 17), (33, 33), (65, 65)]
  # The slots a decoding step reads: the window's 4 and one per skip, whatever the period.
  assert [(c["vis_k"].shape[1], c["vis_v"].shape[1]) for c in cache] == [(6, 6)] * 3


# Sampling.

@pytest.fixture(scope="module")
def small_model():
  return models.create(tiny_model_config("pi_attention", window=4, period=4, num_skips=2),
                       rngs=nnx.Rngs(7))


@pytest.mark.slow  # 10-16 s a model
def test_greedy_is_deterministic_and_follows_the_full_pass(small_model):
  prompt = [5, 9, 11, 2]
  first = generation.generate(small_model, prompt, num_tokens=12, eos_id=1, temperature=0.0)
  again = generation.generate(small_model, prompt, num_tokens=12, eos_id=1, temperature=0.0)
  np.testing.assert_array_equal(first, again)
  # Every greedy token is the argmax of the full pass over the finished sequence.
  sequence = np.concatenate([[1], prompt, first])[None]
  logits_TV = small_model(jnp.asarray(sequence))[0]
  np.testing.assert_array_equal(np.argmax(logits_TV[len(prompt):-1], axis=-1), first)


def test_cached_greedy_equals_the_reference_decoder():
  model = models.create(tiny_model_config("dense"), rngs=nnx.Rngs(8))
  prompt = [3, 4, 5]
  cached = generation.generate(model, prompt, num_tokens=10, eos_id=1, temperature=0.0)
  reference = generation.reference_generate(model, prompt, num_tokens=10, seq_len=32, eos_id=1,
                                        pad_id=0, temperature=0.0)
  np.testing.assert_array_equal(cached, reference)


def test_seeded_sampling_is_reproducible(small_model):
  run = lambda seed: generation.generate(small_model, [5, 9], num_tokens=24, eos_id=1,
                                     temperature=1.0, top_k=0, seed=seed)
  np.testing.assert_array_equal(run(3), run(3))
  assert not np.array_equal(run(3), run(4))


def test_top_k_and_top_p_keep_only_the_likely_tokens():
  logits_1V = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  draw = lambda **kw: np.asarray(jax.vmap(lambda key: generation.sample_logits(
      logits_1V, key, temperature=1.0, **kw)[0])(jax.random.split(jax.random.key(0), 2000)))
  assert set(draw(top_k=2)) == {0, 1}
  assert set(draw(top_p=0.75)) == {0, 1}  # 0.5 + 0.3 reaches 0.75
  assert set(draw(top_p=0.85)) == {0, 1, 2}
  assert set(draw(top_p=0.1)) == {0}      # the most likely token always stays
  assert set(draw()) == {0, 1, 2, 3}
  with pytest.raises(ValueError, match="top_p"):
    generation.check_sampling(1.0, 0, 1.5)


# The command line.

def run_cli(*args):
  return subprocess.run([sys.executable, "-m", "efficient_lm.sample", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # trains a workdir and samples in a subprocess
def test_cli_samples_a_workdir(tiny_config, tmp_path):
  config = tiny_config("pi_attention", num_steps=10, sample_tokens=0)
  config.model.update(window=8, period=8, num_skips=2)
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(build(config), workdir)
  args = [f"--workdir={workdir}", "--prompt=thou art", "--max_new_tokens=12", "--temperature=0"]
  first, second = run_cli(*args), run_cli(*args)
  assert first.returncode == 0, first.stderr
  assert first.stdout.startswith("thou art") and len(first.stdout) > len("thou art\n")
  assert first.stdout == second.stdout  # greedy: the same text twice, and nothing else on stdout
  assert "from " + workdir in first.stderr
  # Non-ASCII text stays as typed; only \\n, \\t and \\\\ are escapes.
  unicode = run_cli(f"--workdir={workdir}", "--prompt=café\\nÆsop’s\\tx\\\\n", "--max_new_tokens=3",
                    "--temperature=0")
  assert unicode.returncode == 0, unicode.stderr
  assert unicode.stdout.startswith("café\nÆsop’s\tx\\n")


def test_unescape_reads_only_newline_tab_and_backslash():
  assert sample.unescape("caf\u00e9 \\n\\t\\\\ \\u00e9 \\x") == "caf\u00e9 \n\t\\ \\u00e9 \\x"


@pytest.mark.slow
def test_learned_positions_refuse_to_generate_past_seq_len():
  cfg = tiny_model_config("dense", position="learned", seq_len=16)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="learned positions"):
    generation.generate(model, [5, 6, 7], num_tokens=13, eos_id=2, temperature=0.0)
  with pytest.raises(ValueError, match="max_len=17 exceeds model.seq_len=16"):
    model.init_cache(1, 17)
  # What fits is generated, with finite logits (the pad id is never forced out of NaNs).
  out = generation.generate(model, [5, 6, 7], num_tokens=12, eos_id=2, temperature=0.0)
  assert out.shape == (12,)
  logits, _ = model.prefill(jnp.asarray([[2, 5, 6, 7]]), model.init_cache(1, 16))
  assert np.all(np.isfinite(logits))


def test_cli_refuses_a_directory_that_is_not_a_workdir(tmp_path):
  result = run_cli(f"--workdir={tmp_path}", "--prompt=x")
  assert result.returncode == 2
  assert "config.json" in result.stderr and "not a training workdir" in result.stderr
  assert result.stdout == ""


def test_cli_refuses_bad_sampling_settings(tmp_path):
  result = run_cli(f"--workdir={tmp_path}", "--temperature=-1")
  assert result.returncode == 2 and "temperature" in result.stderr
