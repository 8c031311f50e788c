"""BCMT's and HOnly's settings for the shared model tests (tests/families/__init__.py)."""

FIELDS = {"bcmt": dict(block_size=8, alpha=0.8), "honly": dict(block_size=8)}
TASKS = {
    "bcmt": (dict(block_size=16), 3, lambda t: t % 16 >= 3),  # inside the block
    "honly": (dict(block_size=16), 3, lambda t: t % 16 >= 3),
}
DECODING = [
    ("bcmt", dict(block_size=8)),
    ("bcmt", dict(block_size=8, position="learned", tie_embeddings=False, seq_len=40)),
    ("honly", dict(block_size=8)),
    ("bcmt", dict(block_size=8, num_kv_heads=2)),  # grouped-query attention
]
