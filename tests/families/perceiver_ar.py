"""The Perceiver-AR family's settings for the shared model tests (tests/families/__init__.py);
its cached decoding has tests of its own (tests/test_perceiver_decoding.py: the logits cover only
the latents), so no `DECODING`."""

VARIANTS = ("perceiver_ar", "double_attention", "compressed_double_attention",
            "ssplit_double_attention")
FIELDS = {name: dict(num_latents=8, compression=4, num_history_segments=3) for name in VARIANTS}
TASKS = {
    "perceiver_ar": (dict(num_latents=8), 12, lambda t: t >= 24),  # latents copy from the history
    "double_attention": (dict(num_latents=8), 12, lambda t: t >= 24),
    "ssplit_double_attention": (dict(num_latents=8, num_history_segments=4), 12, lambda t: t >= 24),
    # The compressed history cannot hold every token: copy between latents.
    "compressed_double_attention": (dict(num_latents=8, compression=4), 3, lambda t: t >= 27),
}
