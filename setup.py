"""efficient_lm: efficient long-context language models in JAX/Flax."""

import setuptools

setuptools.setup(
    name="efficient_lm",
    version="0.1.0",
    description="A JAX/Flax model zoo of efficient long-context language models.",
    packages=setuptools.find_packages(include=["efficient_lm", "efficient_lm.*"]),
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.7.1",
        "flax>=0.12.0",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11.20",
        "tensorflow-datasets>=4.9.9",
        "array-record>=0.8.1",
        "grain>=0.2.12",
        "sentencepiece>=0.2.0",
        "ml-collections>=1.0.0",
        "absl-py>=2.1.0",
        "etils[epath]>=1.7.0",
        "importlib_resources>=6.0",  # tfds' epath needs it, TensorFlow does not come in
        "tensorboardX>=2.6.2",  # TensorBoard event files without TensorFlow
        "numpy>=1.26",
        "matplotlib>=3.8",  # experiments/: the benchmark and probe plots
    ],
    extras_require={
        "test": ["pytest>=8.0", "pytest-xdist>=3.5",
                 "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29"],  # the notebook tests
    },
)
