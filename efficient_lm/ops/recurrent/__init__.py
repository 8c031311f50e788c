"""Linear-recurrent ops: the gated delta rule (docs/architecture.md, "The gated delta rule").

Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025.
Per token t of a document, with a state S `[K, V]` per head:

    S <- exp(g_t) S                              (decay, g_t <= 0)
    S <- S + beta_t k_t (v_t - S^T k_t)^T        (delta rule write, beta_t in (0, 1))
    o_t = S^T (scale q_t)

S is 0 before a document's first token, and `initial_state` (or 0) before position 0.

- `gated_delta_rule`: the whole sequence, trained in its chunked form (`chunked.py`: the UT
  transform inside chunks of `chunk_size` tokens, a `lax.scan` of the state across them; O(T)
  time and memory, never a `[T, T]` array); `impl='pallas'` runs that scan as a Pallas kernel
  (`kernel.py`); with `mesh` the sequence is sharded over `axis_name` (`ring.py`: each device's
  affine state map composed across devices).
- `gated_delta_rule_step`: one token of the recurrence, for decoding (a constant-size state).
- `gated_linear_rule` and `gated_linear_rule_step`: the same without the delta rule, the gated
  linear recurrence of Mamba-2 (S <- exp(g_t) S + k_t v_t^T; o_t = S^T (scale q_t)): Gated
  DeltaNet's ablation, through the same chunked form, ring and kernel (W = 0, U' = V).
"""

import jax
import jax.numpy as jnp

from efficient_lm.ops.recurrent import chunked as chunked_lib
from efficient_lm.ops.recurrent import kernel
from efficient_lm.ops.recurrent import ring
from efficient_lm.config.errors import is_int

IMPLS = ("xla", "pallas")
F32 = jnp.float32


def _scale(scale: float | None, K: int) -> float:
  return K ** -0.5 if scale is None else scale


def _check(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids_BT, initial_state_BHKV,
           chunk_size, impl) -> None:
  """ValueError, one line naming the argument, for arrays or settings the op cannot take
  (`beta_BTH` None: the linear recurrence, which has none)."""
  if q_BTHK.ndim != 4:
    raise ValueError(f"q must be [B, T, H, K], got shape {q_BTHK.shape}")
  B, T, H, K = q_BTHK.shape
  expect = {"k": (k_BTHK, (B, T, H, K)), "v": (v_BTHV, (B, T, H, v_BTHV.shape[-1])),
            "g": (g_BTH, (B, T, H))}
  if beta_BTH is not None:
    expect["beta"] = (beta_BTH, (B, T, H))
  if segment_ids_BT is not None:
    expect["segment_ids"] = (segment_ids_BT, (B, T))
  if initial_state_BHKV is not None:
    expect["initial_state"] = (initial_state_BHKV, (B, H, K, v_BTHV.shape[-1]))
  for name, (x, shape) in expect.items():
    if tuple(x.shape) != shape:
      raise ValueError(f"{name} has shape {tuple(x.shape)}; with q of shape {tuple(q_BTHK.shape)} "
                       f"(and v's width) it must be {shape}")
  if T < 1:
    raise ValueError("the sequence is empty (T=0): the gated delta rule needs at least one token")
  if not is_int(chunk_size) or chunk_size < 1:
    raise ValueError(f"chunk_size={chunk_size!r} must be a positive integer (tokens per chunk)")
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} must be one of {', '.join(IMPLS)}")


def gated_delta_rule(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHV: jax.Array, g_BTH: jax.Array,
                     beta_BTH: jax.Array, *, scale: float | None = None,
                     segment_ids: jax.Array | None = None,
                     initial_state: jax.Array | None = None, chunk_size: int = 64,
                     impl: str = "xla", mesh: jax.sharding.Mesh | None = None,
                     axis_name: str = "context", interpret: bool = False
                     ) -> tuple[jax.Array, jax.Array]:
  """(o `[B, T, H, V]` in q's dtype, the state after the last token `[B, H, K, V]` float32).

  q, k `[B, T, H, K]`, v `[B, T, H, V]`, g (log decay, <= 0) and beta (in (0, 1)) `[B, T, H]`;
  `scale` multiplies q (default K^-1/2). `segment_ids` `[B, T]`: a token whose id differs from
  the previous one starts a document, from a zero state. Computed in float32 whatever the
  inputs' dtype. `impl`: 'xla' (a `lax.scan` of the state across chunks) or 'pallas' (that scan
  as a Pallas kernel; `interpret=True` off a TPU). With `mesh` (more than one device along
  `axis_name`) the T axis is sharded over it and each device holds T / devices tokens.
  """
  return _run(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, scale=scale, segment_ids=segment_ids,
              initial_state=initial_state, chunk_size=chunk_size, impl=impl, mesh=mesh,
              axis_name=axis_name, interpret=interpret, delta=True)


def gated_linear_rule(q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHV: jax.Array, g_BTH: jax.Array,
                      *, scale: float | None = None, segment_ids: jax.Array | None = None,
                      initial_state: jax.Array | None = None, chunk_size: int = 64,
                      impl: str = "xla", mesh: jax.sharding.Mesh | None = None,
                      axis_name: str = "context", interpret: bool = False
                      ) -> tuple[jax.Array, jax.Array]:
  """`gated_delta_rule` without the delta rule (Mamba-2's gated linear recurrence): per token
  S <- exp(g_t) S + k_t v_t^T, o_t = S^T (scale q_t); the same arguments but beta, the same
  outputs, documents, chunked form, ring and kernel."""
  return _run(q_BTHK, k_BTHK, v_BTHV, g_BTH, None, scale=scale, segment_ids=segment_ids,
              initial_state=initial_state, chunk_size=chunk_size, impl=impl, mesh=mesh,
              axis_name=axis_name, interpret=interpret, delta=False)


def _run(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, *, scale, segment_ids, initial_state,
         chunk_size, impl, mesh, axis_name, interpret, delta: bool):
  _check(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids, initial_state, chunk_size, impl)
  B, _, H, K = q_BTHK.shape
  V = v_BTHV.shape[-1]
  scale = _scale(scale, K)
  scan = chunked_lib.state_scan
  if impl == "pallas":
    scan = kernel.state_scan_fn(interpret)
  if mesh is not None:
    if ring.devices(mesh, axis_name) > 1:
      o_BTHV, final_BHKV = ring.gated_delta_rule(
          q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, segment_ids, initial_state, scale=scale,
          chunk_size=chunk_size, scan=scan, mesh=mesh, axis_name=axis_name, delta=delta)
      return o_BTHV.astype(q_BTHK.dtype), final_BHKV
  starts_BT = None if segment_ids is None else chunked_lib.starts_of(segment_ids)
  state_BHKV = jnp.zeros((B, H, K, V), F32) if initial_state is None else initial_state
  o_BTHV, final_BHKV = chunked_lib.chunked(q_BTHK.astype(F32) * scale, k_BTHK, v_BTHV, g_BTH,
                                           beta_BTH, starts_BT, state_BHKV, chunk_size, scan,
                                           delta)
  return o_BTHV.astype(q_BTHK.dtype), final_BHKV


def gated_delta_rule_step(state_BHKV: jax.Array, q_BHK: jax.Array, k_BHK: jax.Array,
                          v_BHV: jax.Array, g_BH: jax.Array, beta_BH: jax.Array,
                          scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  """One token of the recurrence (decoding): (o `[B, H, V]` in q's dtype, the new state
  `[B, H, K, V]` float32). A document's first token takes a zero state."""
  S_BHKV = jnp.exp(g_BH.astype(F32))[..., None, None] * state_BHKV.astype(F32)
  k_BHK32 = k_BHK.astype(F32)
  error_BHV = v_BHV.astype(F32) - jnp.einsum("bhkv,bhk->bhv", S_BHKV, k_BHK32)
  S_BHKV = S_BHKV + jnp.einsum("bhk,bhv->bhkv", beta_BH.astype(F32)[..., None] * k_BHK32,
                               error_BHV)
  return _read(S_BHKV, q_BHK, scale), S_BHKV


def gated_linear_rule_step(state_BHKV: jax.Array, q_BHK: jax.Array, k_BHK: jax.Array,
                           v_BHV: jax.Array, g_BH: jax.Array, scale: float | None = None
                           ) -> tuple[jax.Array, jax.Array]:
  """One token of `gated_linear_rule` (decoding): (o `[B, H, V]` in q's dtype, the new state)."""
  S_BHKV = (jnp.exp(g_BH.astype(F32))[..., None, None] * state_BHKV.astype(F32)
            + jnp.einsum("bhk,bhv->bhkv", k_BHK.astype(F32), v_BHV.astype(F32)))
  return _read(S_BHKV, q_BHK, scale), S_BHKV


def _read(S_BHKV: jax.Array, q_BHK: jax.Array, scale: float | None) -> jax.Array:
  """o = S^T (scale q), in q's dtype."""
  q_BHK32 = q_BHK.astype(F32) * _scale(scale, q_BHK.shape[-1])
  return jnp.einsum("bhkv,bhk->bhv", S_BHKV, q_BHK32).astype(q_BHK.dtype)
