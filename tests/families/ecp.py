"""ECP's settings for the shared model tests (tests/families/__init__.py)."""

FIELDS = {"ecp": dict(num_segments=4, shared_kv=False, rope_first_layer_only=False)}
TASKS = {"ecp": (dict(num_segments=4), 8, lambda t: t >= 8)}  # always in the previous piece
DECODING = [
    ("ecp", dict(num_segments=4)),
    ("ecp", dict(num_segments=4, shared_kv=True, rope_first_layer_only=True)),  # unrolled layers
    ("ecp", dict(num_segments=4, num_kv_heads=2)),  # grouped-query attention ...
    ("ecp", dict(num_segments=4, shared_kv=True, num_kv_heads=1)),  # ... one shared k = v head
]
