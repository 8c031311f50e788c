"""Gated DeltaNet's settings for the shared model tests (tests/families/__init__.py)."""

# Two layers: the recurrence (chunks of 8, so several chunks and a ragged tail) and a
# sliding-window hybrid layer; the convolution's 3 taps cross chunk and document boundaries.
FIELDS = {"gated_deltanet": dict(conv_size=3, chunk_size=8, hybrid_every=2, window=5)}
TASKS = {
    # 7 back: past what the convolutions reach (2 taps back a layer, 4 over two layers), so only
    # the recurrence can carry it; every layer recurrent.
    "gated_deltanet": (dict(conv_size=3, chunk_size=8), 7, lambda t: t >= 7),
}
DECODING = [
    ("gated_deltanet", dict(conv_size=3, chunk_size=8)),            # scanned layers, recurrent only
    ("gated_deltanet", dict(conv_size=4, chunk_size=16, delta_rule=False)),  # the Mamba-2 ablation
    ("gated_deltanet", dict(conv_size=2, chunk_size=8, hybrid_every=2, hybrid_mixer="pi_attention",
                            window=3, period=4, num_skips=2)),      # a π hybrid layer
    ("gated_deltanet", dict(conv_size=1, chunk_size=4, value_ratio=1, position="learned",
                            tie_embeddings=False, seq_len=40)),     # no convolution tail
]
