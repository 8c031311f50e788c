"""Attention ops on `[B, T, H, K]` arrays (the layout of `jax.nn.dot_product_attention`): the
public functional API, for users, tests and experiments.

Each op names one `Pattern` and calls the route every model uses (`ops.route.Route.attend`);
the pattern's constructor checks its sizes, the route its mesh and layout, the core the
backend and the arrays, so nothing is checked here twice. `impl` is the backend ('xla', the
blockwise loop core, O(T) memory, a flash backward, by default; 'splash' on TPU, 'gpu' on GPU;
'reference', the dense O(T^2) masked softmax the tests compare with; a kernel backend off its
hardware runs only with `interpret=True`); with `mesh=` (more than one device along
`axis_name`) the sequence is sharded (`ops.ring`: context parallelism). `segment_ids` `[B, T]`
(document ids) confine every query to its own document. Keys and values may have fewer heads than
the queries, `[B, T, H_kv, K]` with H_kv dividing H (grouped-query attention: query head h reads
key/value head h // (H / H_kv)), on every backend, never repeated in memory (`ops.core.heads`).

- `causal_attention`, `block_local_attention`, `sliding_window_attention`, `pi_attention`:
  causal self-attention.
- `causal_cross_attention`: Perceiver-AR's Z latent queries, the last of a stream of T keys,
  each seeing the keys up to its own position. O(Z * T) time, never a `[T, T]` array.
- `segment_attention`: bidirectional attention inside disjoint equal segments (the refined
  history of the double-attention models). O(T^2 / num_segments).
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops.pattern import Pattern
from efficient_lm.ops.priors import gate_priors
from efficient_lm.ops.route import Route
from efficient_lm.config.errors import is_int


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
  route = Route(impl=impl, interpret=interpret, mesh=mesh, axis_name=axis_name, layout=layout)
  return route.attend(q_BTHK, k_BTHK, v_BTHK, Pattern.dense(), scale=scale,
                      segment_ids=segment_ids)


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
  route = Route(impl=impl, interpret=interpret, mesh=mesh, axis_name=axis_name)
  return route.attend(q_BTHK, k_BTHK, v_BTHK, Pattern.blocks(block_size, lookback), scale=scale,
                      segment_ids=segment_ids)


def sliding_window_attention(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *,
                             window: int, scale: float | None = None, impl: str = "xla",
                             interpret: bool = False, segment_ids: jax.Array | None = None,
                             mesh: jax.sharding.Mesh | None = None,
                             axis_name: str = "context") -> jax.Array:
  """Token i attends to j with i - window < j <= i. Cost O(T * window), memory O(T)."""
  route = Route(impl=impl, interpret=interpret, mesh=mesh, axis_name=axis_name)
  return route.attend(q_BTHK, k_BTHK, v_BTHK, Pattern.sliding(window), scale=scale,
                      segment_ids=segment_ids)


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
  `gate_logits_BTH` (exact: log_sigmoid(+-logit)); exactly one of them
  (`ops.priors.gate_priors`). Cost O(T * (window + num_skips)): the core's
  banded window plus the skip keys read as shifted slices.
  """
  pattern = Pattern.pi(window, period, num_skips, seq_len=q_BTHK.shape[1])
  local_BTH, skip_BTH = gate_priors(gate_BTH, gate_logits_BTH)
  priors = {}
  if pattern.has_skips:  # with no skip, log(g) shifts every logit of a row equally: no prior
    priors = dict(local_prior=local_BTH, skip_prior=skip_BTH)
  route = Route(impl=impl, interpret=interpret, mesh=mesh, axis_name=axis_name)
  return route.attend(q_BTHK, k_BTHK, v_BTHK, pattern, scale=scale, segment_ids=segment_ids,
                      **priors)


def causal_cross_attention(q_BZHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *,
                           query_offset: int, scale: float | None = None, impl: str = "xla",
                           interpret: bool = False, segment_ids: jax.Array | None = None
                           ) -> jax.Array:
  """Query z sits at stream position `query_offset + z` and attends to every key j <= it.

  `query_offset = T - Z` is Perceiver-AR's latent cross-attention (the keys
  are the history followed by the latents); `query_offset = 0` with Z = T is
  plain causal self-attention. `segment_ids` `[B, T]`: the stream's document
  ids. Scores and softmax in float32.
  """
  Z, T = q_BZHK.shape[1], k_BTHK.shape[1]
  if not is_int(query_offset) or not 0 <= query_offset <= T - Z:
    raise ValueError(f"query_offset={query_offset!r} must be an integer in [0, T - Z] = [0, {T - Z}]")
  ids = {} if segment_ids is None else dict(
      segment_ids=segment_ids[:, query_offset:query_offset + Z], k_segment_ids=segment_ids)
  return Route(impl=impl, interpret=interpret).attend(
      q_BZHK, k_BTHK, v_BTHK, Pattern.dense(), q_start=query_offset, scale=scale, **ids)


def segment_attention(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHK: jax.Array, *,
                      num_segments: int = 1, scale: float | None = None, impl: str = "xla",
                      interpret: bool = False, segment_ids: jax.Array | None = None) -> jax.Array:
  """Bidirectional (unmasked) attention inside each of `num_segments` equal, disjoint segments
  (and inside each document, with `segment_ids`).

  num_segments=1 is full bidirectional attention. T must be a multiple of
  num_segments; T = 0 (no history) returns an empty array.
  """
  T = q_BTHK.shape[1]
  if not is_int(num_segments) or num_segments < 1 or T % num_segments:
    raise ValueError(f"num_segments={num_segments!r} must be a positive divisor of T={T}")
  if T == 0:
    return jnp.zeros_like(q_BTHK)
  return Route(impl=impl, interpret=interpret).attend(
      q_BTHK, k_BTHK, v_BTHK, Pattern.segments(T // num_segments), scale=scale,
      segment_ids=segment_ids)
