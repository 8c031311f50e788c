"""Text generation: cached decoding for every model (the command line: `efficient_lm.sample`).

`generate` prefills the prompt in one parallel pass (or in chunks of
`prefill_chunk` tokens), then decodes one token per step with the model's cache
under one jitted `jax.lax.scan`. Every context starts with an end-of-document
token, as every document does in training; a model with a fixed `prompt_window`
(the Perceiver-AR family: its history) gets it left-padded with more of them. The caches (see each model's
`init_cache`) are sized for the whole generation up front: the efficient
models' are fixed by their window, blocks or segments; the dense baseline's
holds every token.

`reference_generate` is the plain uncached decoder (one full forward pass per
token over a window of `seq_len` tokens); tests compare the two.
"""

import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from efficient_lm import checkpoint
from efficient_lm import models
from efficient_lm import train_state
from efficient_lm import workdir as workdir_lib
from efficient_lm.data import corpus as corpus_lib


def sample_logits(logits_BV: jax.Array, key: jax.Array, *, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> jax.Array:
  """Greedy when temperature == 0; else softmax sampling from the top-k logits (k > 0) and the
  smallest set of tokens whose probability reaches top_p (top_p < 1)."""
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1)
  logits_BV = logits_BV.astype(jnp.float32) / temperature
  if top_k > 0:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
  if top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    before_BV = jnp.cumsum(jax.nn.softmax(sorted_BV, axis=-1), axis=-1) - jax.nn.softmax(sorted_BV)
    # Keep a token while the mass of the tokens ranked above it is below top_p (the first always).
    cutoff_B1 = jnp.min(jnp.where(before_BV < top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
  return jax.random.categorical(key, logits_BV, axis=-1)


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
  """Clear errors for sampling settings, before anything compiles."""
  if not temperature >= 0.0:
    raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
  if not (isinstance(top_k, int) and top_k >= 0):
    raise ValueError(f"top_k={top_k} must be an integer >= 0 (0 = no top-k cut)")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p={top_p} must be in (0, 1] (1 = no nucleus cut)")


def context_room(model: nnx.Module, prompt_len: int) -> int:
  """How many tokens can follow a prompt of `prompt_len` tokens (and the end-of-document token
  before it): unbounded with RoPE, the rest of the position table with learned positions."""
  max_positions = getattr(model, "max_positions", None)
  if max_positions is None:
    return sys.maxsize
  window = getattr(model, "prompt_window", None) or 0
  return max_positions - max(prompt_len + 1, window)


def prefill(model: nnx.Module, tokens_BT: jax.Array, cache, chunk: int | None = None,
            segment_ids_BT: jax.Array | None = None):
  """(logits at the last prompt position `[B, V]`, cache): one parallel pass, or chunks of `chunk`
  tokens (the first by `prefill`, the rest by `extend`) when the prompt is longer.
  `segment_ids_BT`: the prompt's document ids (None: one document)."""
  T = tokens_BT.shape[1]
  first = T if chunk is None else min(chunk, T)
  ids = lambda a, b: None if segment_ids_BT is None else segment_ids_BT[:, a:b]
  logits, cache = model.prefill(tokens_BT[:, :first], cache, ids(0, first))
  for start in range(first, T, chunk or T):
    logits, cache = model.extend(tokens_BT[:, start:start + chunk], cache, start,
                                 ids(start, start + chunk))
  return logits[:, -1], cache


def generate(model: nnx.Module, prompt_ids, *, num_tokens: int, eos_id: int,
             temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0, seed: int = 0,
             prefill_chunk: int | None = None, vocab_size: int | None = None,
             document_mask: bool = False) -> np.ndarray:
  """`num_tokens` new token ids continuing the 1-D `prompt_ids` (a document's start). With
  `vocab_size` (the tokenizer's) no id at or past it is ever drawn, even from a model whose
  vocabulary is larger. `document_mask`: the model was trained within documents
  (`data.document_mask`): an end-of-document token, in the prompt or drawn, opens a new one."""
  check_sampling(temperature, top_k, top_p)
  if prefill_chunk is not None and prefill_chunk < 1:
    raise ValueError(f"prefill_chunk={prefill_chunk} must be at least 1 (or None: one pass)")
  if num_tokens < 1:
    raise ValueError(f"num_tokens={num_tokens} must be at least 1")
  context = [eos_id] + [int(t) for t in prompt_ids]
  room = context_room(model, len(context) - 1)
  if num_tokens > room:
    raise ValueError(f"{num_tokens} new tokens after a prompt of {len(context) - 1} do not fit the "
                     f"model's learned positions (model.seq_len={model.max_positions} in all, the "
                     f"end-of-document token that starts the context included): generate at most "
                     f"{max(room, 0)}, or train with model.position='rope'")
  window = getattr(model, "prompt_window", None)
  if window:  # left-padded with end-of-document tokens (or cut) to the model's window
    context = ([eos_id] * (window - len(context)) + context)[-window:]
  context = np.asarray(context, np.int32)[None]
  P = context.shape[1]
  context_ids = corpus_lib.document_ids(context, eos_id) if document_mask else None
  graphdef, params = nnx.split(model)
  def sample(logits_BV, key):
    if vocab_size is not None and vocab_size < logits_BV.shape[-1]:
      logits_BV = jnp.where(jnp.arange(logits_BV.shape[-1]) < vocab_size, logits_BV, -jnp.inf)
    return sample_logits(logits_BV, key, temperature=temperature, top_k=top_k,
                         top_p=top_p).astype(jnp.int32)

  @jax.jit
  def run(params, context_BP, ids_BP, key):
    model = nnx.merge(graphdef, params)
    logits_BV, cache = prefill(model, context_BP, model.init_cache(1, P + num_tokens),
                               prefill_chunk, ids_BP)
    first_B = sample(logits_BV, jax.random.fold_in(key, 0))
    last_id_B = None if ids_BP is None else ids_BP[:, -1]

    def body(carry, i):  # params ride in the carry so the module is built at the body's level
      params, cache, token_B, id_B = carry
      if id_B is not None:  # the token's document: an end-of-document token opens the next
        id_B = id_B + (token_B == eos_id).astype(jnp.int32)
      logits_BV, cache = nnx.merge(graphdef, params).decode_step(token_B, cache, P + i, id_B)
      next_B = sample(logits_BV, jax.random.fold_in(key, i + 1))
      return (params, cache, next_B, id_B), next_B

    _, rest_NB = jax.lax.scan(body, (params, cache, first_B, last_id_B),
                              jnp.arange(num_tokens - 1))
    return jnp.concatenate([first_B[None], rest_NB], axis=0)[:, 0]

  ids = None if context_ids is None else jnp.asarray(context_ids)
  return np.asarray(run(params, jnp.asarray(context), ids, jax.random.key(seed)))


def generate_text(model: nnx.Module, tokenizer, prompt: str, *, num_tokens: int, seed: int = 0,
                  temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0,
                  prefill_chunk: int | None = None, document_mask: bool = False) -> str:
  """The prompt followed by its sampled continuation, decoded."""
  prompt_ids = tokenizer.encode(prompt)
  new_ids = generate(model, prompt_ids, num_tokens=num_tokens, eos_id=tokenizer.eos_id,
                     temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                     prefill_chunk=prefill_chunk, vocab_size=tokenizer.vocab_size,
                     document_mask=document_mask)
  return tokenizer.decode(np.concatenate([prompt_ids, new_ids]))


def reference_generate(model: nnx.Module, prompt_ids, *, num_tokens: int, seq_len: int,
                       eos_id: int, pad_id: int, temperature: float = 0.8, top_k: int = 40,
                       seed: int = 0, document_mask: bool = False) -> np.ndarray:
  """The uncached decoder: one forward pass over a window of `seq_len` tokens per new token.

  While the context is shorter than the window it is placed at the start and
  padded after (a causal model never sees the padding); a model that returns
  logits only for its last positions (Perceiver-AR) gets it right-aligned after
  end-of-document tokens instead.
  """
  graphdef, params = nnx.split(model)
  num_logits = jax.eval_shape(lambda p, x: nnx.merge(graphdef, p)(x), params,
                              jax.ShapeDtypeStruct((1, seq_len), jnp.int32)).shape[1]

  @jax.jit
  def next_token(params, window_T, index, key):
    ids = None
    if document_mask:
      ids = jnp.cumsum(window_T[None] == eos_id, axis=1, dtype=jnp.int32)
    logits_1TV = nnx.merge(graphdef, params)(window_T[None], segment_ids_BT=ids)
    return sample_logits(logits_1TV[:, index], key, temperature=temperature, top_k=top_k)[0]

  tokens = [eos_id] + [int(t) for t in prompt_ids]
  key = jax.random.key(seed)
  for i in range(num_tokens):
    context = tokens[-seq_len:]
    if len(context) < seq_len and num_logits == seq_len:  # left-aligned, padding after
      window, index = context + [pad_id] * (seq_len - len(context)), len(context) - 1
    else:  # right-aligned: the last position is the last token
      window, index = [eos_id] * (seq_len - len(context)) + context, num_logits - 1
    window_T = jnp.asarray(window, dtype=jnp.int32)
    tokens.append(int(next_token(params, window_T, index, jax.random.fold_in(key, i))))
  return np.asarray(tokens[-num_tokens:], dtype=np.int32)


# The command line: sample from a training workdir.



def load_workdir(workdir: str, mesh: jax.sharding.Mesh | None = None
                 ) -> tuple[nnx.Module, "object", ml_collections.ConfigDict, int]:
  """(model with the latest checkpoint's parameters, tokenizer, config, step) from a workdir.

  The parameters are restored straight onto `mesh` with the workdir's sharding rules (a model
  that needed FSDP to train fits the same way), or onto one device; the model uses the
  single-device ops whatever mesh it was trained on.
  """
  from efficient_lm.data.tokenizer import open_tokenizer  # pylint: disable=import-outside-toplevel

  wd = workdir_lib.Workdir(workdir)
  wd.require_trained()
  config = wd.saved_config()
  built = train_state.build(config, mesh, abstract=True)
  ckpt = checkpoint.Checkpointer(wd.checkpoints, max_to_keep=None)
  restored = ckpt.restore_latest(built.state, lambda meta: None, set_aside=False)
  ckpt.close()
  if restored is None:
    raise workdir_lib.WorkdirError(f"{workdir}/checkpoints has no checkpoint yet: train first, or wait for "
                       "the first save (train.checkpoint_every)")
  step, state, _ = restored
  return nnx.merge(built.graphdef, state.params), open_tokenizer(wd.file(workdir_lib.TOKENIZER)), \
      config, step


def sample_from_state(config: ml_collections.ConfigDict, params, tokenizer, prompt: str, *,
                      num_tokens: int, seed: int = 0) -> str | None:
  """A sample from trained `params` (any mesh) with the single-device model of `config`.

  With learned positions the sample stops where the position table ends
  (`model.seq_len` tokens in all, the prompt included); None if no token fits.
  """
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.create(config.model, rngs=nnx.Rngs(0))))
  model = nnx.merge(graphdef, params)
  room = context_room(model, len(tokenizer.encode(prompt)))
  if room < 1:
    return None
  return generate_text(model, tokenizer, prompt, num_tokens=min(num_tokens, room), seed=seed,
                       document_mask=config.data.document_mask)
