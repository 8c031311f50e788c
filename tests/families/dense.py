"""dense's settings for the shared model tests (tests/families/__init__.py)."""

FIELDS = {"dense": {}}
TASKS = {"dense": (dict(), 5, lambda t: t >= 5)}
DECODING = [("dense", {}), ("dense", dict(num_kv_heads=1))]  # and multi-query attention
