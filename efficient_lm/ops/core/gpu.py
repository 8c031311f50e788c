"""The `gpu` backend (placeholder while it is built): every call runs on `xla`."""

from efficient_lm.ops.core import backends

backends.register(backends.Backend(
    name="gpu", attend=None, unsupported=lambda call: "the gpu backend is not built yet",
    platforms=("tpu",) if "gpu" == "splash" else ("gpu",)))
