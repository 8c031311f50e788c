"""The Gated DeltaNet mixer (docs/architecture.md, "Gated DeltaNet"): a gated delta-rule recurrence
instead of attention.

Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025. Per
layer, on the block's normed input x `[B, T, D]`, with H heads of key width K and value width V:

    q, k, v = SiLU(conv(x W_q)), SiLU(conv(x W_k)), SiLU(conv(x W_v))   a short causal depthwise
                                                                         convolution per channel
    q, k = q / |q|, k / |k|                                              per head
    g = -exp(A_log) softplus(x W_a + dt_bias)                            log of the decay alpha
    beta = sigmoid(x W_b)                                                the write strength
    o = gated_delta_rule(q, k, v, g, beta)                               ops.recurrent
    y = W_o (RMSNorm(o) * SiLU(x W_g))                                   the norm per head, over V

`delta_rule=False` is the ablation, Mamba-2's gated linear recurrence (`gated_linear_rule`: no
beta, no W_b). Documents (`segment_ids`): the recurrence restarts from a zero state at a
document's first token, and the convolution never reads a token of another document.

One function, `mix`, runs every mode: the whole sequence (with `route.mesh` the sequence is sharded:
the op's ring, and the convolution's taps from the device behind through `route.shift_right`), and
from a carried state (`init_cache`): decoding, a prompt's chunks, and the sequence chunks of
`model.seq_chunk` (`chunk_context`: a `lax.scan` of the chunks carrying the state). The state is
constant in size: the `[B, H, K, V]` state and the convolution's last conv_size - 1 inputs.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from efficient_lm.config.model import ModelConfig
from efficient_lm.models import layers
from efficient_lm.ops import precision
from efficient_lm.ops import recurrent
from efficient_lm.ops.route import Route
from efficient_lm.parallel import sharding

F32 = jnp.float32
EPSILON = 1e-6  # in the L2 norms of q and k and in the output norm


def resolve_impl(impl: str) -> str:
  """`model.recurrent_impl` on the platform being traced for: 'auto' is the Pallas kernel on a
  TPU, `lax.scan` ('xla') elsewhere (the kernel is a TPU (Mosaic) kernel)."""
  if impl != "auto":
    return impl
  return "pallas" if precision.platform() == "tpu" else "xla"


def _init_A_log(key: jax.Array, shape: tuple) -> jax.Array:
  """log A with A ~ U(0, 16) per head (the paper's code); the decay rate is -A softplus(...)."""
  return jnp.log(jax.random.uniform(key, shape, F32, 1e-4, 16.0))


def _init_dt_bias(key: jax.Array, shape: tuple) -> jax.Array:
  """softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1] per head (Mamba-2's time step): at
  initialisation softplus(dt_bias) = dt, so the decay -A dt starts slow."""
  dt = jnp.exp(jax.random.uniform(key, shape, F32, math.log(1e-3), math.log(1e-1)))
  dt = jnp.maximum(dt, 1e-4)
  return dt + jnp.log(-jnp.expm1(-dt))


@jax.custom_vjp
def weighted_taps(kernel_WF: jax.Array, taps: tuple[jax.Array, ...]) -> jax.Array:
  """sum_i kernel[i] * taps[i], each tap `[B, T, *F]`, the kernel `[W, *F]`: elementwise (one
  fused loop), with its own backward (tap i's cotangent kernel[i] dy, kernel i's the sum of tap i
  x dy over B and T). Not the taps stacked `[W, B, T, F]` and contracted with the kernel in one
  einsum (a dot of contraction W): that copy made a Gated DeltaNet train step at 16K tokens 1.41x
  slower on a 2-core CPU when the two were measured side by side (f98340b)."""
  y = kernel_WF[0] * taps[0]
  for kernel_F, tap in zip(kernel_WF[1:], taps[1:]):
    y = y + kernel_F * tap
  return y


def _weighted_taps_fwd(kernel_WF, taps):
  return weighted_taps(kernel_WF, taps), (kernel_WF, taps)


def _weighted_taps_bwd(residuals, dy):
  kernel_WF, taps = residuals
  batch_and_length = tuple(range(dy.ndim - kernel_WF.ndim + 1))
  d_kernel = jnp.stack([jnp.sum(tap * dy, axis=batch_and_length) for tap in taps])
  return d_kernel, tuple(kernel_F * dy for kernel_F in kernel_WF)


weighted_taps.defvjp(_weighted_taps_fwd, _weighted_taps_bwd)


class CausalConv(nnx.Module):
  """A depthwise causal convolution along T of `[B, T, *features]`: `width` taps per feature, tap
  i multiplying the token width - 1 - i back; a token of another document is read as 0."""

  def __init__(self, width: int, features: tuple[int, ...], names: tuple[str, ...], *,
               rngs: nnx.Rngs):
    bound = width ** -0.5  # PyTorch's Conv1d default (fan-in = width for a depthwise one)
    self.kernel = nnx.Param(jax.random.uniform(rngs.params(), (width, *features), F32, -bound,
                                               bound), **layers.axes("conv", *names))
    self.width = width

  def __call__(self, x_BTF: jax.Array, seg_BT: jax.Array | None, route: Route,
               tail: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """float32 `[B, T, *features]`. `tail`: (the width - 1 inputs before x `[B, W - 1, *features]`,
    their document ids `[B, W - 1]`, -1 where empty) with `seg_BT` given; None: x starts the
    sequence (zeros before it; with `route.mesh` the W - 1 tokens before each device's chunk come
    from the devices behind, one halo: `route.shifts_right`)."""
    W, T = self.width, x_BTF.shape[1]
    kernel_WF = self.kernel[...].astype(F32)
    x_BTF = x_BTF.astype(F32)
    if tail is None:  # x[:, i - j] and its document for j = 1 .. W - 1
      x_taps = route.shifts_right(x_BTF, W - 1)
      seg_taps = None if seg_BT is None else route.shifts_right(seg_BT, W - 1)
    else:  # the tail and x as one window, each tap a static slice of it
      window_x = jnp.concatenate([tail[0].astype(F32), x_BTF], axis=1)
      window_seg = jnp.concatenate([tail[1], seg_BT], axis=1)
      x_taps = [window_x[:, W - 1 - j:W - 1 - j + T] for j in range(1, W)]
      seg_taps = [window_seg[:, W - 1 - j:W - 1 - j + T] for j in range(1, W)]
    # Tap i the token W - 1 - i back, weighed by the kernel's row i (`weighted_taps`).
    taps = [*x_taps[::-1], x_BTF]
    if seg_BT is not None:  # a token of another document reads as 0
      expand = lambda m_BT: m_BT.reshape(*m_BT.shape, *(1,) * (x_BTF.ndim - 2))
      taps = [jnp.where(expand(s_BT == seg_BT), x_j, 0.0)
              for x_j, s_BT in zip(taps[:-1], seg_taps[::-1])] + [x_BTF]
    return weighted_taps(kernel_WF, tuple(taps))


def _l2_normalized(x_BTHK: jax.Array) -> jax.Array:
  return x_BTHK * jax.lax.rsqrt(jnp.sum(jnp.square(x_BTHK), axis=-1, keepdims=True) + EPSILON)


class GatedDeltaNet(nnx.Module):
  """The mixer (module docstring). No attention: `patterns` is empty, and a sequence chunk gets
  its output from `chunk_context`, which carries the state across the chunks."""

  def __init__(self, cfg: ModelConfig, *, route: Route, rngs: nnx.Rngs):
    D, H = cfg.d_model, cfg.num_heads
    K = D // H
    V = cfg.value_ratio * K
    dtype = layers.dtype_of(cfg.dtype)
    self.num_heads, self.key_dim, self.value_dim = H, K, V
    self.route = route
    self.dtype = dtype
    self.delta_rule = cfg.delta_rule
    self.chunk_size = cfg.chunk_size
    self.recurrent_impl = cfg.recurrent_impl
    self.interpret = cfg.kernel_interpret
    linear = lambda features, names: nnx.LinearGeneral(
        D, features, use_bias=False, dtype=dtype, rngs=rngs, kernel_metadata=layers.axes(*names))
    self.qk = linear((2, H, K), ("embed", "qkv", "heads", "kv"))
    self.vg = linear((2, H, V), ("embed", "qkv", "heads", "value"))  # v and the output gate
    # The decay's rate and (with the delta rule) beta, before their nonlinearities.
    self.rates = linear((2 if cfg.delta_rule else 1, H), ("embed", "qkv", "heads"))
    self.conv_qk = CausalConv(cfg.conv_size, (2, H, K), ("qkv", "heads", "kv"), rngs=rngs)
    self.conv_v = CausalConv(cfg.conv_size, (H, V), ("heads", "value"), rngs=rngs)
    self.A_log = nnx.Param(_init_A_log(rngs.params(), (H,)), **layers.axes("heads"))
    self.dt_bias = nnx.Param(_init_dt_bias(rngs.params(), (H,)), **layers.axes("heads"))
    self.out_norm = nnx.Param(jnp.ones((V,), F32), **layers.axes("value"))
    self.out = nnx.Linear(H * V, D, use_bias=False, dtype=dtype, rngs=rngs,
                          kernel_metadata=layers.axes("heads", "embed"))  # heads-major H*V

  @property
  def patterns(self) -> tuple:
    """No attention pattern: a recurrence sees every earlier token of its document."""
    return ()

  def mix(self, x_BTD: jax.Array, segment_ids_BT: jax.Array | None, cache: dict | None = None
          ) -> tuple[jax.Array, dict | None]:
    """(y `[B, T, D]`, the cache after x, or None): x at the sequence start (`cache` None: the
    whole sequence, sharded if the route is) or after the tokens `cache` holds."""
    B, T, _ = x_BTD.shape
    H, K, V = self.num_heads, self.key_dim, self.value_dim
    if cache is not None:
      segment_ids_BT = layers.document_ids(segment_ids_BT, B, T)
    qk_BT2HK = sharding.constrain(self.qk(x_BTD), "batch", "length", None, "heads", "kv")
    vg_BT2HV = sharding.constrain(self.vg(x_BTD), "batch", "length", None, "heads", None)
    raw_v_BTHV, gate_BTHV = vg_BT2HV[:, :, 0], vg_BT2HV[:, :, 1]
    tails = (None, None) if cache is None else ((cache["conv_qk"], cache["seg"]),
                                                 (cache["conv_v"], cache["seg"]))
    qk_BT2HK32 = jax.nn.silu(self.conv_qk(qk_BT2HK, segment_ids_BT, self.route, tails[0]))
    q_BTHK = _l2_normalized(qk_BT2HK32[:, :, 0]).astype(self.dtype)
    k_BTHK = _l2_normalized(qk_BT2HK32[:, :, 1]).astype(self.dtype)
    v_BTHV = jax.nn.silu(self.conv_v(raw_v_BTHV, segment_ids_BT, self.route, tails[1])).astype(
        self.dtype)
    rates_BTnH = precision.einsum_f32("btd,dnh->btnh", x_BTD.astype(self.dtype),
                                      self.rates.kernel[...].astype(self.dtype))
    g_BTH = -jnp.exp(self.A_log[...]) * jax.nn.softplus(rates_BTnH[:, :, 0] + self.dt_bias[...])
    beta_BTH = jax.nn.sigmoid(rates_BTnH[:, :, 1]) if self.delta_rule else None
    state_BHKV = None
    if cache is not None:  # a document starting at x's first token starts from a zero state
      continues_B = cache["doc"] == segment_ids_BT[:, 0]
      state_BHKV = jnp.where(continues_B[:, None, None, None], cache["state"], 0.0)
    if cache is not None and T == 1:  # a decoding step: the recurrence itself
      args = (state_BHKV, q_BTHK[:, 0], k_BTHK[:, 0], v_BTHV[:, 0], g_BTH[:, 0])
      if self.delta_rule:
        o_BHV, final_BHKV = recurrent.gated_delta_rule_step(*args, beta_BTH[:, 0])
      else:
        o_BHV, final_BHKV = recurrent.gated_linear_rule_step(*args)
      o_BTHV = o_BHV[:, None]
    else:
      common = dict(segment_ids=segment_ids_BT, initial_state=state_BHKV,
                    chunk_size=self.chunk_size, impl=resolve_impl(self.recurrent_impl),
                    interpret=self.interpret, axis_name=self.route.axis_name,
                    mesh=self.route.mesh if cache is None else None)
      if self.delta_rule:
        o_BTHV, final_BHKV = recurrent.gated_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH,
                                                        **common)
      else:
        o_BTHV, final_BHKV = recurrent.gated_linear_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, **common)
    y_BTD = self.output(o_BTHV, gate_BTHV)
    if cache is None:
      return y_BTD, None
    def last(old, new):  # the cache's tail moved on by x: its last W - 1 entries
      both = jnp.concatenate([old, new.astype(old.dtype)], axis=1)
      return both[:, both.shape[1] - old.shape[1]:]

    return y_BTD, {"state": final_BHKV, "conv_qk": last(cache["conv_qk"], qk_BT2HK),
                   "conv_v": last(cache["conv_v"], raw_v_BTHV),
                   "seg": last(cache["seg"], segment_ids_BT), "doc": segment_ids_BT[:, -1]}

  def output(self, o_BTHV: jax.Array, gate_BTHV: jax.Array) -> jax.Array:
    """W_o (RMSNorm(o) * SiLU(gate)): the norm per head over V (statistics in float32), one
    scale shared by the heads."""
    B, T, H, V = o_BTHV.shape
    o32 = o_BTHV.astype(F32)
    normed = o32 * jax.lax.rsqrt(jnp.mean(jnp.square(o32), axis=-1, keepdims=True) + EPSILON)
    gated = normed * self.out_norm[...] * jax.nn.silu(gate_BTHV.astype(F32))
    return self.out(gated.astype(self.dtype).reshape(B, T, H * V))

  def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array,
               segment_ids_BT: jax.Array | None = None) -> jax.Array:
    del positions_BT  # the recurrence is ordered by itself: no position enters it
    return self.mix(x_BTD, segment_ids_BT)[0]

  # Sequence-chunked blocks (`models/chunking.py`, `decoder.ChunkContext`): the chunks in order,
  # each from the state the one before left (the halo is 0: no keys are read).

  def keys_values(self, x_BWD: jax.Array, positions_BW: jax.Array) -> tuple[jax.Array, jax.Array]:
    """No keys or values (zero-width placeholders the block passes on unread)."""
    del positions_BW
    empty = jnp.zeros((*x_BWD.shape[:2], self.num_heads, 0), x_BWD.dtype)
    return empty, empty

  def chunk_context(self, window, x_nBCD, positions_nBC, xh_nBHD, ph_nBH, seg_n, starts_n,
                    halo: int, chunk: int) -> jax.Array:
    """Every chunk's mixer output `[n, B, C, D]`: a `lax.scan` over the chunks carrying the state
    and the convolution's tail, each chunk rematerialized in the backward pass.
    `window(x_BCD, positions_BC, xh_BHD, ph_BH)` is the block's own (the normed chunk first)."""
    del starts_n, halo, chunk
    n, B, C = x_nBCD.shape[:3]
    ids_nBC = seg_n[0] if seg_n[0] is not None else jnp.zeros((n, B, C), jnp.int32)

    @jax.checkpoint
    def one_chunk(cache, inputs):
      x_BCD, positions_BC, xh_BHD, ph_BH, ids_BC = inputs
      h_BCD = window(x_BCD, positions_BC, xh_BHD, ph_BH)[0]
      y_BCD, cache = self.mix(h_BCD, ids_BC, cache)
      return cache, y_BCD

    _, y_nBCD = jax.lax.scan(one_chunk, self.init_cache(B),
                             (x_nBCD, positions_nBC, xh_nBHD, ph_nBH, ids_nBC))
    return y_nBCD

  def attend_chunk_with(self, context, x_BCD, positions_BC, k_BWHK, v_BWHK, q_start, k_offset,
                        q_align, segment_ids=None) -> jax.Array:
    """The chunk's output came with the context (the block's inputs go unused)."""
    return context

  # Cached decoding: the state and the convolution's last inputs, whatever the context.

  def init_cache(self, batch_size: int, max_len: int = 0) -> dict:
    """Constant size (`max_len` is not needed): the `[B, H, K, V]` state (float32), the
    convolution's last conv_size - 1 inputs and their document ids (-1: none yet), and the
    document of the last token."""
    del max_len
    B, H, K, V, W = batch_size, self.num_heads, self.key_dim, self.value_dim, self.conv_qk.width
    return {"state": jnp.zeros((B, H, K, V), F32),
            "conv_qk": jnp.zeros((B, W - 1, 2, H, K), self.dtype),
            "conv_v": jnp.zeros((B, W - 1, H, V), self.dtype),
            "seg": jnp.full((B, W - 1), -1, jnp.int32), "doc": jnp.full((B,), -1, jnp.int32)}

  def prefill(self, x_BTD: jax.Array, positions_BT: jax.Array, cache: dict,
              segment_ids_BT: jax.Array | None = None) -> tuple[jax.Array, dict]:
    del positions_BT
    return self.mix(x_BTD, segment_ids_BT, cache)

  def extend(self, x_BCD: jax.Array, start: jax.Array, cache: dict,
             segment_ids_BC: jax.Array | None = None) -> tuple[jax.Array, dict]:
    del start  # where the tokens are follows from the state itself
    return self.mix(x_BCD, segment_ids_BC, cache)
