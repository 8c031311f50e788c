"""Attention ops on `[B, T, H, K]` arrays (the layout of `jax.nn.dot_product_attention`): the
public functional API.

Each op is one `Pattern` through the route every model uses (`ops.route.attend`): on the
backend `impl` ('xla', the blockwise loop core, O(T) memory, a flash backward, by default;
'splash' on TPU, 'gpu' on GPU; 'reference', the dense O(T^2) masked softmax the tests compare
with; a kernel backend off its hardware runs only with `interpret=True`), and with `mesh=` the
sequence sharded along `axis_name` (`ops.ring`: context parallelism). `segment_ids` `[B, T]`
(document ids) confine every query to its own document.
"""

import jax

from efficient_lm.ops import route as route_lib
from efficient_lm.ops.priors import GATE_EPS, gate_priors  # noqa: F401  (public)
from efficient_lm.ops.core import backends
from efficient_lm.ops.pattern import Pattern
from efficient_lm.ops.route import shift_right  # noqa: F401  (public: part of this API)


def _route(impl: str, interpret: bool, mesh, axis_name: str, layout: str) -> route_lib.Route:
  sharded = mesh is not None and axis_name in mesh.axis_names and mesh.shape[axis_name] > 1
  return route_lib.Route(impl=backends.canonical(impl), interpret=interpret,
                         mesh=mesh if sharded else None, axis_name=axis_name, layout=layout)


def _attend(q_BTHK, k_BTHK, v_BTHK, pattern: Pattern, *, scale, impl: str, interpret: bool,
            mesh=None, axis_name: str = "context", layout: str = "natural", **kwargs) -> jax.Array:
  route = _route(impl, interpret, mesh, axis_name, layout)
  return route.attend(q_BTHK, k_BTHK, v_BTHK, pattern, scale=scale, **kwargs)


def causal_attention(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *,
                     scale: float | None = None, impl: str = "xla", interpret: bool = False,
                     segment_ids: jax.Array | None = None, mesh: jax.sharding.Mesh | None = None,
                     axis_name: str = "context", layout: str = "natural") -> jax.Array:
  """Causal softmax attention: token i attends to every j <= i.

  `impl="xla"` (or its earlier name "flash"): the blockwise core over all past
  key blocks (O(T) memory, O(T^2) time, future blocks skipped). `"reference"`:
  the dense `[T, T]` masked softmax. `"gpu"` (or "cudnn"): cuDNN / the Pallas
  kernel on a GPU; `"splash"`: the TPU kernel. With `mesh`: ring attention
  (`layout='zigzag'`: the arrays already in that order, see `ring.to_layout`).
  """
  return _attend(q_BTHK, k_BTHK, v_BTHK, Pattern.dense(), scale=scale, impl=impl,
                 interpret=interpret, segment_ids=segment_ids, mesh=mesh, axis_name=axis_name,
                 layout=layout)


def _check_positive(name: str, value: int) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name}={value!r} must be a positive integer")


def block_local_attention(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *,
                          block_size: int, lookback: int = 0, scale: float | None = None,
                          impl: str = "xla", interpret: bool = False,
                          segment_ids: jax.Array | None = None,
                          mesh: jax.sharding.Mesh | None = None,
                          axis_name: str = "context") -> jax.Array:
  """Token i of block b = i // block_size attends to every j <= i with b - lookback <= j // block_size.

  lookback=0 is BCMT's local attention, lookback=1 ECP's pair of segments. Any
  T (with `mesh`, each device's T / devices a multiple of block_size). Cost
  O(T * (lookback + 1) * block_size), memory O(T).
  """
  _check_positive("block_size", block_size)
  if not isinstance(lookback, int) or isinstance(lookback, bool) or lookback < 0:
    raise ValueError(f"lookback={lookback!r} must be a non-negative integer")
  return _attend(q_BTHK, k_BTHK, v_BTHK, Pattern.blocks(block_size, lookback), scale=scale,
                 impl=impl, interpret=interpret, segment_ids=segment_ids, mesh=mesh,
                 axis_name=axis_name)


def sliding_window_attention(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *,
                             window: int, scale: float | None = None, impl: str = "xla",
                             interpret: bool = False, segment_ids: jax.Array | None = None,
                             mesh: jax.sharding.Mesh | None = None,
                             axis_name: str = "context") -> jax.Array:
  """Token i attends to j with i - window < j <= i. Cost O(T * window), memory O(T)."""
  _check_positive("window", window)
  return _attend(q_BTHK, k_BTHK, v_BTHK, Pattern.sliding(window), scale=scale, impl=impl,
                 interpret=interpret, segment_ids=segment_ids, mesh=mesh, axis_name=axis_name)


def skip_offsets(T: int, *, window: int, period: int, num_skips: int) -> list[int]:
  """The skip distances m * period (m = 1..num_skips) that can ever be used at length T.

  A skip inside the window (m * period < window) is already a local key; one at
  or beyond T never lands on a position.
  """
  return list(Pattern.pi(window, period, num_skips, seq_len=T).skips)


def pi_attention(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array,
                 gate_BTH: jax.Array | None = None, *, window: int, period: int, num_skips: int,
                 scale: float | None = None, gate_logits_BTH: jax.Array | None = None,
                 impl: str = "xla", interpret: bool = False, segment_ids: jax.Array | None = None,
                 mesh: jax.sharding.Mesh | None = None, axis_name: str = "context") -> jax.Array:
  """π-Attention: the causal window plus periodic skips, one softmax over their union.

  Token i attends to {j : i - window < j <= i} and to the skips i - m * period
  (m = 1..num_skips, i - m * period >= 0, not inside the window). log(g) is
  added to every local logit and log(1 - g) to every skip logit, with the gate
  g given as `gate_BTH` (clamped to [1e-6, 1 - 1e-6]) or as its logit
  `gate_logits_BTH` (exact: log_sigmoid(+-logit)); exactly one of them. Cost
  O(T * (window + num_skips)): the core's banded window plus the skip keys read
  as shifted slices.
  """
  _check_positive("window", window)
  _check_positive("period", period)
  if not isinstance(num_skips, int) or isinstance(num_skips, bool) or num_skips < 0:
    raise ValueError(f"num_skips={num_skips!r} must be a non-negative integer")
  local_BTH, skip_BTH = gate_priors(gate_BTH, gate_logits_BTH)
  pattern = Pattern.pi(window, period, num_skips, seq_len=q_BTHK.shape[1])
  priors = {}
  if pattern.skips:  # with no skip, log(g) shifts every logit of a row equally: no prior
    priors = dict(local_prior=local_BTH, skip_prior=skip_BTH)
  return _attend(q_BTHK, k_BTHK, v_BTHK, pattern, scale=scale, impl=impl, interpret=interpret,
                 segment_ids=segment_ids, mesh=mesh, axis_name=axis_name, **priors)
