"""π-Attention's and the sliding window's settings for the shared model tests
(tests/families/__init__.py)."""

FIELDS = {
    "pi_attention": dict(window=5, period=7, num_skips=3, period_schedule="doubling",
                         gate_hidden=8),
    "sliding_window": dict(window=5),
}
TASKS = {
    "sliding_window": (dict(window=8), 5, lambda t: t >= 5),
    "pi_attention": (dict(window=4, period=7, num_skips=2, period_schedule="constant"), 7,
                     lambda t: t >= 7),  # only a skip reaches 7 back: the window stops at 3
}
DECODING = [
    ("sliding_window", dict(window=6)),
    ("pi_attention", dict(window=5, period=2, num_skips=4)),  # P < W: some skips inside the window
    ("pi_attention", dict(window=3, period=4, num_skips=3, period_schedule="doubling")),
    ("pi_attention", dict(window=5, period=2, num_skips=4, num_kv_heads=2)),  # grouped-query
    ("sliding_window", dict(window=6, num_kv_heads=1)),  # multi-query, the visible-slot buffer
]
