"""A model with learned positions refuses what its position table cannot hold, and says what fits:
fewer new tokens, or (when the prompt alone fills the table) a prompt of a given length."""

import pytest
from flax import nnx

from efficient_lm import models
from efficient_lm.inference import generation
from test_models import tiny_model_config

SEQ_LEN = 16  # the position table: the end-of-document token, the prompt and the new tokens


@pytest.fixture(scope="module")
def model():
  cfg = tiny_model_config("dense", position="learned", seq_len=SEQ_LEN)
  return nnx.eval_shape(lambda: models.create(cfg, rngs=nnx.Rngs(0)))  # shapes only: no compute


def _refusal(model, prompt_len: int, num_tokens: int) -> str:
  with pytest.raises(ValueError) as e:  # refused before any work: the model has no weights here
    generation.generate_batch(model, [[5] * prompt_len, [6]], num_tokens=num_tokens, eos_id=2)
  assert "\n" not in str(e.value)
  return str(e.value)


def test_too_many_new_tokens_names_both_fixes(model):
  message = _refusal(model, prompt_len=3, num_tokens=13)  # 1 + 3 + 13 = 17 > 16
  assert message.startswith("13 new tokens after a prompt of 3 do not fit the model's learned "
                            "positions (model.seq_len=16 in all")
  assert "generate at most 12, or give a prompt of at most 2 tokens, or train with " \
         "model.position='rope'" in message


@pytest.mark.parametrize("prompt_len", [15, 40])  # 1 + 15 = 16: the prompt fills the table
def test_a_prompt_that_fills_the_table_is_told_how_short_it_must_be(model, prompt_len):
  message = _refusal(model, prompt_len=prompt_len, num_tokens=4)
  assert message.startswith(f"a prompt of {prompt_len} tokens leaves no room for new tokens in "
                            "the model's learned positions (model.seq_len=16 in all")
  assert "give a prompt of at most 11 tokens for 4 new tokens" in message  # 1 + 11 + 4 = 16
  assert "at most 0" not in message and "generate at most" not in message


def test_too_many_new_tokens_after_any_prompt(model):
  message = _refusal(model, prompt_len=15, num_tokens=15)  # no prompt leaves 15
  assert "15 would not fit after any prompt: give a shorter prompt and at most 14 new tokens" \
         in message


def test_what_fits_is_not_refused(model):
  contexts = generation._contexts(model, [[5] * 3], 12, 2)  # pylint: disable=protected-access
  assert contexts == [[2, 5, 5, 5]]
