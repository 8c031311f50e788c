"""The `splash` backend (placeholder while it is built): every call runs on `xla`."""

from efficient_lm.ops.core import backends

backends.register(backends.Backend(
    name="splash", attend=None, unsupported=lambda call: "the splash backend is not built yet",
    platforms=("tpu",) if "splash" == "splash" else ("gpu",)))
