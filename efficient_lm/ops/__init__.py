"""Pure functional ops on arrays: attention variants, memories, the gated delta rule (`recurrent`),
their ring versions.

A wing of the package (docs/architecture.md, "The wings"): it may import `config` (the static-int
check of `config.errors`) and `runtime` (`jax_compat`); never `parallel` or `data`, its siblings,
nor anything above (the models call the ops, the ops know no model).
"""
