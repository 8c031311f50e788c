#!/usr/bin/env bash
# On a lent GPU or TPU: the attention backends against the reference, then train-step speed,
# MFU and memory of every model against dense (experiments/accelerator_check.py; under 8 minutes).
#
#   bash experiments/accelerator_check.sh        # JSON summary in experiments/results/
#
# Without a GPU or TPU it says so in one line and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
platform=$(python -c 'import jax; print(jax.devices()[0].platform)' 2>/dev/null || echo "none")
case "$platform" in
  gpu|cuda|rocm|tpu) ;;
  *) echo "accelerator_check: no GPU or TPU on this machine (jax platform: $platform); nothing to check."
     exit 0 ;;
esac
export PYTHONUNBUFFERED=1
timeout 470 python -m experiments.accelerator_check "$@"
