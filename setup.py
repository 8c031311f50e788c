"""efficient_lm: efficient long-context language models in JAX/Flax."""

import os
import re

import setuptools


def read_version() -> str:
  """`__version__` from efficient_lm/__init__.py, read as text (nothing is imported)."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "efficient_lm", "__init__.py")
  with open(path, encoding="utf-8") as f:
    match = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.MULTILINE)
  if match is None:
    raise RuntimeError(f"no __version__ = \"...\" line in {path}")
  return match.group(1)


def read_jax_requirement() -> str:
  """The jax versions the library is tested with: `JAX_REQUIREMENT` in
  efficient_lm/runtime/jax_compat.py (the one module that touches jax's private API), read as
  text."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "efficient_lm", "runtime",
                      "jax_compat.py")
  with open(path, encoding="utf-8") as f:
    match = re.search(r'^JAX_REQUIREMENT = "([^"]+)"$', f.read(), re.MULTILINE)
  if match is None:
    raise RuntimeError(f"no JAX_REQUIREMENT = \"...\" line in {path}")
  return match.group(1)


# jax 0.10.2 through 0.12.x. The accelerator extras go through jax's own extras, which pin
# jaxlib, libtpu and the CUDA plugin to the exact jax version pip picks: one version throughout.
JAX = read_jax_requirement()

setuptools.setup(
    name="efficient_lm",
    version=read_version(),
    description="A JAX/Flax model zoo of efficient long-context language models.",
    license="Apache-2.0",
    # configs/ is installed as efficient_lm.configs: `--config=<name>` works without a checkout.
    packages=setuptools.find_packages(include=["efficient_lm", "efficient_lm.*"]) + [
        "efficient_lm.configs"],
    package_dir={"efficient_lm.configs": "configs"},
    package_data={"efficient_lm.parallel.targets": ["gpu/*.txtpb"]},  # GPU descriptions for --target
    python_requires=">=3.10",
    install_requires=[
        f"jax{JAX}",
        "flax>=0.12.4",
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
        "tensorboard>=2.16",  # `tensorboard --logdir runs` (the viewer; pulls no TensorFlow)
        "tokenizers>=0.19",  # data.tokenizer: a Hugging Face tokenizer.json
        "datasets>=2.19",  # data.dataset='hf:<path>'
        "safetensors>=0.4.3",  # python -m efficient_lm.export, efficient_lm.load
        "numpy>=1.26",
        "matplotlib>=3.8",  # experiments/: the benchmark and probe plots
    ],
    extras_require={
        "test": ["pytest>=8.0", "pytest-xdist>=3.5",
                 "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29",  # the notebook tests
                 "lm-eval>=0.4.8", "wandb>=0.19",  # the harness and W&B tests (offline)
                 "import-linter>=2.0"],  # the wings' contract (.importlinter, tests/test_layers.py)
        # python -m efficient_lm.harness: the lm-evaluation-harness (its core needs no torch).
        "eval": ["lm-eval>=0.4.8"],
        # train.wandb=True: Weights & Biases logging (WANDB_MODE=offline works with no network).
        "wandb": ["wandb>=0.19"],
        # Compile for (and run on) TPUs: libtpu. `--target=tpu:...` works from any host with it.
        "tpu": [f"jax[tpu]{JAX}"],
        # Run on NVIDIA GPUs, or compile for them from any host (`--target=gpu:...`): the CUDA
        # plugin and libraries (a compile-only host needs jax-cuda12-plugin, jax-cuda12-pjrt,
        # nvidia-cuda-nvcc-cu12 and nvidia-cudnn-cu12 of them). `gpu-cuda13`: CUDA 13 drivers.
        "gpu": [f"jax[cuda12]{JAX}"],
        "gpu-cuda13": [f"jax[cuda13]{JAX}"],
    },
    entry_points={
        "console_scripts": [
            "efficient-lm-train = efficient_lm.main:run",
            "efficient-lm-sample = efficient_lm.sample:run",
            "efficient-lm-eval = efficient_lm.evaluate:run",
            "efficient-lm-export = efficient_lm.export:run",
            "efficient-lm-harness = efficient_lm.harness:run",
        ],
    },
)
