"""efficient_lm: a JAX/Flax model zoo of efficient long-context language models."""

__version__ = "0.1.0"
