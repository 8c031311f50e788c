"""The gated_deltanet family's own checks (the shared ones read tests/families/gated_deltanet.py):
its short convolution within documents and over a sharded sequence, its num_kv_heads rule, and
its constant decoding state at the default size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import build, load_config
from efficient_lm import models
from efficient_lm.config.errors import ConfigError
from efficient_lm.evaluation.long_context import reach
from efficient_lm.models.gated_deltanet_mixer import CausalConv
from efficient_lm.ops import ring
from efficient_lm.ops.route import Route
from test_models import tiny_model_config


def conv_and_input(T: int = 16, width: int = 4, seed: int = 0):
  conv = CausalConv(width, (3,), ("kv",), rngs=nnx.Rngs(seed))
  x_BTF = jax.random.normal(jax.random.key(seed + 1), (2, T, 3))
  return conv, x_BTF


def test_the_convolution_equals_a_dense_reference_forward_and_gradients():
  """y_t = sum_j kernel[W - 1 - j] x_{t - j} over the j < W with t - j in x's document, as a
  `[T, T]` matrix per feature (a reference: O(T^2)), against the convolution (its taps and
  `weighted_taps`' own backward), with and without documents: outputs, and the gradients of the
  kernel and of x."""
  conv, x_BTF = conv_and_input(T=16, width=4)
  W, T = 4, 16
  seg_BT = jnp.asarray(np.stack([np.repeat([0, 1, 2], [5, 6, 5]), np.repeat([3, 4], [2, 14])]),
                       jnp.int32)
  dy_BTF = jax.random.normal(jax.random.key(7), x_BTF.shape)

  def reference(kernel_WF, x_BTF, seg_BT):
    t, s = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    lag_TT = t - s
    weights_TTF = jnp.where(((lag_TT >= 0) & (lag_TT < W))[..., None],
                            kernel_WF[jnp.clip(W - 1 - lag_TT, 0, W - 1)], 0.0)
    same_BTT = (jnp.ones((2, T, T), bool) if seg_BT is None
                else seg_BT[:, :, None] == seg_BT[:, None, :])
    return jnp.einsum("tsf,bts,bsf->btf", weights_TTF, same_BTT.astype(jnp.float32), x_BTF)

  graphdef, params = nnx.split(conv)  # its one parameter, the kernel

  def ours(kernel_WF, x_BTF, seg_BT):
    return nnx.merge(graphdef, jax.tree.map(lambda _: kernel_WF, params))(x_BTF, seg_BT, Route())

  kernel_WF = conv.kernel[...]
  for seg in (None, seg_BT):
    got, want = ours(kernel_WF, x_BTF, seg), reference(kernel_WF, x_BTF, seg)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    loss = lambda f: lambda k, x: jnp.sum(f(k, x, seg) * dy_BTF)
    got_grads = jax.grad(loss(ours), argnums=(0, 1))(kernel_WF, x_BTF)
    want_grads = jax.grad(loss(reference), argnums=(0, 1))(kernel_WF, x_BTF)
    for g, w in zip(got_grads, want_grads):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_the_convolution_reads_no_token_of_another_document():
  """Document A = tokens 0..5, B = 6..: changing A moves none of B's outputs, though without
  document ids it moves B's first width - 1 (the mask is what stops it); changing B's token 6
  moves B's outputs 6..9 (its taps reach width - 1 ahead) and no further."""
  conv, x_BTF = conv_and_input()
  seg_BT = jnp.broadcast_to((jnp.arange(16) >= 6).astype(jnp.int32), (2, 16))
  moved_A = x_BTF.at[:, :6].add(1.0)
  moved_B = x_BTF.at[:, 6].add(1.0)
  run = lambda x, seg: np.asarray(conv(x, seg, Route()))
  base = run(x_BTF, seg_BT)
  np.testing.assert_array_equal(run(moved_A, seg_BT)[:, 6:], base[:, 6:])
  assert np.all(np.abs(run(moved_A, None)[:, 6:9] - run(x_BTF, None)[:, 6:9]) > 0)
  changed = np.any(run(moved_B, seg_BT) != base, axis=(0, 2))
  assert changed.tolist() == [t in range(6, 10) for t in range(16)]


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices")
@pytest.mark.parametrize("width", [4, 7])  # 7: the halo (6 tokens) reaches two devices back
def test_the_convolution_over_a_sharded_sequence_equals_one_device(width):
  """Over 4 devices (chunks of 4 tokens) the taps before a chunk come from the devices behind,
  one halo of width - 1 tokens (`ring.shifts_right`), documents crossing the device boundaries."""
  mesh = jax.make_mesh((4,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:4])
  conv, x_BTF = conv_and_input(width=width)
  seg_BT = jnp.broadcast_to(jnp.cumsum(jnp.arange(16) % 5 == 3).astype(jnp.int32), (2, 16))
  for seg in (None, seg_BT):
    one = conv(x_BTF, seg, Route())
    sharded = jax.jit(lambda x, s: conv(x, s, Route(mesh=mesh)))(x_BTF, seg)
    np.testing.assert_allclose(sharded, one, rtol=1e-6, atol=1e-6)
  shifted = ring.shifts_right(x_BTF, width - 1, mesh=mesh)
  for j, x_j in enumerate(shifted, start=1):
    np.testing.assert_array_equal(x_j[:, j:], x_BTF[:, :16 - j])
    np.testing.assert_array_equal(x_j[:, :j], 0.0)


def test_num_kv_heads_groups_the_hybrid_layers_only():
  """The recurrent layers keep num_heads heads; without a hybrid layer num_kv_heads is an error
  naming the field, with one its attention takes the grouped heads."""
  with pytest.raises(ConfigError, match=r"^model\.num_kv_heads=2 groups attention's key/value "
                     r"heads, and without model\.hybrid_every this model has no attention layer"):
    tiny_model_config("gated_deltanet", hybrid_every=0, num_kv_heads=2)
  tiny_model_config("gated_deltanet", hybrid_every=0, num_kv_heads=4)
  cfg = tiny_model_config("gated_deltanet", hybrid_every=2, num_kv_heads=2)
  model = models.create(cfg, rngs=nnx.Rngs(0))
  shapes = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(
      nnx.state(model, nnx.Param))}
  hybrid_kv = [s for p, s in shapes.items() if p.endswith("['mixer']['attn']['kv']['kernel'].value")
               or ("['kv']['kernel']" in p and "['1']" in p)]
  recurrent_qk = [s for p, s in shapes.items() if "['qk']['kernel']" in p]
  assert hybrid_kv and all(s[-2] == 2 for s in hybrid_kv), shapes
  assert recurrent_qk and all(s[-2] == cfg.num_heads for s in recurrent_qk), shapes


@pytest.mark.parametrize("preset", [None, "hybrid"])
def test_decoding_state_per_row_is_the_same_at_1k_and_64k(preset):
  """The default config (d_model 256, 4 layers, 4 heads): a row's decoding cache, shapes only, is
  the same at 1,024 and 65,536 tokens of context (the hybrid's sliding window holds its window)."""
  config = load_config("gated_deltanet", preset)
  config.data.vocab_size = 512
  cfg = build(config).model
  model = nnx.eval_shape(lambda: models.create(cfg, rngs=nnx.Rngs(0)))
  per_row = lambda max_len: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
      jax.eval_shape(lambda: model.init_cache(2, max_len)))) / 2
  assert per_row(1024) == per_row(65536) > 0
  if preset is None:  # per layer: the [H, K, V] state, the convolution's W - 1 inputs of q, k and
    # v with their document ids (float32 and int32), the last token's document: 573,504 bytes
    H, K, W = cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.conv_size
    V = cfg.value_ratio * K
    layer = 4 * (H * K * V + (W - 1) * (2 * H * K + H * V) + (W - 1) + 1)
    assert per_row(1024) == cfg.num_layers * layer == 573504


def test_reach_is_any_length_by_its_state_and_the_table_with_learned_positions():
  """Its config declares its input limit (`input_limit`): any length, for the fixed-size state,
  and no warning past seq_len; with learned positions the table's seq_len, refused past it."""
  run = build(load_config("gated_deltanet", "hybrid"))
  most, rule, warning = reach.limit(run)
  assert most is None and warning is None and "fixed-size state" in rule, rule
  assert reach.check(run, [64 * run.model.seq_len]) is None
  config = load_config("gated_deltanet")
  config.model.position = "learned"
  learned = build(config)
  with pytest.raises(reach.LengthError, match=r"model\.position='learned' has a table"):
    reach.check(learned, [learned.model.seq_len + 1])
