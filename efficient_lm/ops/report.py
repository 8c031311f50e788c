"""What a generation's attention runs on: the kernels and the fallbacks of its prefill and of one
decoding step, as the compile report gives them for a train step.

    for line in report.generation_lines(model, batch=2, prompt_len=100, max_len=300):
      print(line, file=sys.stderr)
    report.prompts_lines(model, prompts_ids, num_tokens=200)  # the sample command's

Each part is traced once, abstractly (`backends.trace_record`: nothing runs or compiles): the
prompt's prefill (one pass, or its first `prefill_chunk` tokens and one `extend` of the next
chunk) and one cached decoding step. A whole-prompt prefill runs on a kernel where the platform
has one; a cached step and a chunk after the first attend to a cache's slots at explicit
positions, which the kernels refuse: those calls run on `xla` and are listed with the reason.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from efficient_lm.ops.core import backends


def generation_records(model, *, batch: int, prompt_len: int, max_len: int,
                       prefill_chunk: int | None = None) -> dict[str, dict]:
  """{"prefill": record, "decode step": record} (`backends.recorded` dicts) of `model`'s
  generation: a cache of `max_len` tokens for `batch` rows, a prompt of `prompt_len`."""
  graphdef, state = nnx.split(model)
  first = prompt_len if not prefill_chunk else min(prefill_chunk, prompt_len)

  def prefill(state, tokens_BT):
    model = nnx.merge(graphdef, state)
    logits, cache = model.prefill(tokens_BT[:, :first], model.init_cache(batch, max_len))
    if first < prompt_len:  # the chunks after the first: `extend` against the cache
      logits, cache = model.extend(tokens_BT[:, first:first + prefill_chunk], cache, first)
    return logits

  def decode_step(state, token_B):
    model = nnx.merge(graphdef, state)
    return model.decode_step(token_B, model.init_cache(batch, max_len), prompt_len)[0]

  tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
  token = jax.ShapeDtypeStruct((batch,), jnp.int32)
  return {"prefill": backends.trace_record(prefill, state, tokens),
          "decode step": backends.trace_record(decode_step, state, token)}


def generation_lines(model, *, batch: int, prompt_len: int, max_len: int,
                     prefill_chunk: int | None = None) -> list[str]:
  """One `backends.report_line` each for the prefill and a decoding step."""
  records = generation_records(model, batch=batch, prompt_len=prompt_len, max_len=max_len,
                               prefill_chunk=prefill_chunk)
  return [backends.report_line(record, label) for label, record in records.items()]


def prompts_lines(model, prompts_ids, *, num_tokens: int,
                  prefill_chunk: int | None = None) -> list[str]:
  """`generation_lines` for a batched generation of `prompts_ids` (`generation.generate_batch`:
  the shortest context, the prompt after its end-of-document token, prefilled in one pass or in
  chunks), its cache `num_tokens` longer, within a learned position table (`max_positions`)."""
  prompt_len = 1 + min(len(ids) for ids in prompts_ids)
  max_len = prompt_len + num_tokens
  limit = getattr(model, "max_positions", None)
  if limit is not None:
    max_len = min(max_len, limit)
    prompt_len = min(prompt_len, max_len - 1)
  return generation_lines(model, batch=len(prompts_ids), prompt_len=max(prompt_len, 1),
                          max_len=max_len, prefill_chunk=prefill_chunk)
