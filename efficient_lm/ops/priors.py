"""π-Attention's gate as log-priors of one softmax: log g on the local logits, log(1 - g) on the
skip logits."""

import jax
import jax.numpy as jnp

GATE_EPS = 1e-6


def gate_priors(gate_BTH: jax.Array | None = None, gate_logits_BTH: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
  """π's log-priors (local, skip), float32: log g and log(1 - g).

  From the gate g (clamped to [1e-6, 1 - 1e-6]) or, exactly at any logit z,
  from `gate_logits_BTH`: log_sigmoid(z) and log_sigmoid(-z). Exactly one of
  the two must be given.
  """
  if (gate_BTH is None) == (gate_logits_BTH is None):
    raise ValueError("pass exactly one of gate_BTH (the gate in (0, 1)) and gate_logits_BTH "
                     "(its logit; exact near 0 and 1)")
  if gate_logits_BTH is not None:
    z_BTH = gate_logits_BTH.astype(jnp.float32)
    return jax.nn.log_sigmoid(z_BTH), jax.nn.log_sigmoid(-z_BTH)
  g_BTH = jnp.clip(gate_BTH.astype(jnp.float32), GATE_EPS, 1.0 - GATE_EPS)
  return jnp.log(g_BTH), jnp.log1p(-g_BTH)
