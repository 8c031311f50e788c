#!/usr/bin/env bash
# A venv shaped like the GPU machine's Python, for rehearsing the device check here: Python 3.12,
# jax / jaxlib 0.11.2 (CPU only: no CUDA plugin), the packages the machine has that pip serves,
# and none of those it lacks (ml-collections, grain, tensorflow-datasets, array-record,
# tensorboardX: checked). docs/accelerators.md, "The device check".
#
#   PYTHON312=/path/to/python3.12 bash experiments/device_venv.sh DEST
#   PYTHON=DEST/bin/python ACCELERATOR_CHECK_PLATFORM=cpu bash experiments/accelerator_check.sh
set -euo pipefail
dest=${1:?usage: bash experiments/device_venv.sh DEST}
python=${PYTHON312:-python3.12}
"$python" -m venv "$dest"
"$dest/bin/python" -m pip install -q "jax==0.11.2" "jaxlib==0.11.2" "numpy>=2.5" "sentencepiece>=0.2.2" \
  flax optax orbax-checkpoint chex absl-py etils tensorstore tensorboard matplotlib pytest \
  pytest-xdist scipy pandas psutil tqdm rich
absent=$("$dest/bin/python" -m pip list 2>/dev/null | grep -iE '^(ml.collections|grain|tensorflow.datasets|array.record|tensorboardX) ' || true)
if [ -n "$absent" ]; then
  echo "device_venv: FAIL: $dest holds what the GPU machine lacks: $absent"
  exit 1
fi
echo "device_venv: $dest ($("$dest/bin/python" --version), jax $("$dest/bin/python" -c 'import jax; print(jax.__version__)'))"
