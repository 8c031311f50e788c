"""Text generation from a trained model.

`generate` is the plain reference decoder: every new token runs the model on
a window of `seq_len` tokens and samples from the logits at the last real
token. The context starts with an end-of-document token, as every document does
in training. While it is shorter than the window it is placed at the start and
padded after (a causal model never sees the padding); a model that returns
logits only for its last positions (Perceiver-AR) gets it right-aligned after
end-of-document tokens instead. It costs one full forward pass per token.
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
             eos_id: int, pad_id: int, temperature: float = 0.8, top_k: int = 40, seed: int = 0
             ) -> np.ndarray:
  """Returns `num_tokens` new token ids continuing the 1-D `prompt_ids` (a document's start)."""
  graphdef, params = nnx.split(model)
  num_logits = jax.eval_shape(lambda p, x: nnx.merge(graphdef, p)(x), params,
                              jax.ShapeDtypeStruct((1, seq_len), jnp.int32)).shape[1]

  @jax.jit
  def next_token(params, window_T, index, key):
    logits_1TV = nnx.merge(graphdef, params)(window_T[None])
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


def generate_text(model: nnx.Module, tokenizer, prompt: str, *, num_tokens: int, seq_len: int,
                  seed: int = 0, temperature: float = 0.8, top_k: int = 40) -> str:
  """The prompt followed by its sampled continuation, decoded."""
  prompt_ids = tokenizer.encode(prompt)
  new_ids = generate(model, prompt_ids, num_tokens=num_tokens, seq_len=seq_len,
                     eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, temperature=temperature,
                     top_k=top_k, seed=seed)
  return tokenizer.decode(np.concatenate([prompt_ids, new_ids]))
