"""Text generation from a trained model.

`generate` is the plain reference decoder: every new token runs the model on
the last `seq_len` tokens (right-aligned, end-of-document tokens before a short
prompt, as documents start in training) and samples from the logits at the
last position. It works for every model, since every model returns logits for
its last position; it costs one full forward pass per token.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def sample_logits(logits_BV: jax.Array, key: jax.Array, *, temperature: float, top_k: int = 0
                  ) -> jax.Array:
  """Greedy when temperature == 0; else softmax sampling, optionally from the top-k logits only."""
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1)
  logits_BV = logits_BV / temperature
  if top_k > 0:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
  return jax.random.categorical(key, logits_BV, axis=-1)


def generate(model: nnx.Module, prompt_ids: np.ndarray, *, num_tokens: int, seq_len: int,
             pad_id: int, temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> np.ndarray:
  """Returns `num_tokens` new token ids continuing the 1-D `prompt_ids`."""
  graphdef, params = nnx.split(model)

  @jax.jit
  def next_token(params, window_T, key):
    logits_1TV = nnx.merge(graphdef, params)(window_T[None])
    return sample_logits(logits_1TV[:, -1], key, temperature=temperature, top_k=top_k)[0]

  tokens = [pad_id] * seq_len + [int(t) for t in prompt_ids]
  key = jax.random.key(seed)
  for i in range(num_tokens):
    window_T = jnp.asarray(tokens[-seq_len:], dtype=jnp.int32)
    tokens.append(int(next_token(params, window_T, jax.random.fold_in(key, i))))
  return np.asarray(tokens[-num_tokens:], dtype=np.int32)


def generate_text(model: nnx.Module, tokenizer, prompt: str, *, num_tokens: int, seq_len: int,
                  seed: int = 0, temperature: float = 0.8, top_k: int = 40) -> str:
  """The prompt followed by its sampled continuation, decoded."""
  prompt_ids = tokenizer.encode(prompt)
  new_ids = generate(model, prompt_ids, num_tokens=num_tokens, seq_len=seq_len,
                     pad_id=tokenizer.eos_id, temperature=temperature, top_k=top_k, seed=seed)
  return tokenizer.decode(np.concatenate([prompt_ids, new_ids]))
