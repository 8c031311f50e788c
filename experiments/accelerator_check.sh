#!/usr/bin/env bash
# The device check (experiments/accelerator_check.py; docs/accelerators.md, "The device check"):
# every attention backend and cuDNN against the reference on the device, then each model's train
# step (speed, MFU, peak memory) in its own process; JSON rewritten after every row.
#
#   bash experiments/device_wheels.sh          # once, where pip reaches PyPI: .whl/ (carry it)
#   bash experiments/accelerator_check.sh      # on the device: $OUT/accelerator_check.json
#   ACCELERATOR_CHECK_PLATFORM=cpu bash experiments/accelerator_check.sh   # the whole path, tiny
#
# PYTHON (default python3) runs it; the wheels in .whl/ (ACCELERATOR_CHECK_WHEELS) are installed
# with --no-deps into .site/ (ACCELERATOR_CHECK_SITE), first on PYTHONPATH. OUT (default
# runs/accelerator_check) receives the JSON. The run stops itself after ACCELERATOR_CHECK_BUDGET
# seconds (default 470) and is killed at +60 s.
# Exit 0: passed, or no GPU / TPU (jax reports none and none is visible); 1: a check failed;
# 2: python, jax or the library cannot start; 124: killed for time. A failure ends in one line.
set -uo pipefail
case "$0" in */*) cd "${0%/*}/.." ;; *) cd .. ;; esac || exit 2
fail() { echo "accelerator_check: FAIL: $*"; exit 2; }

PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null 2>&1 || fail "no '$PYTHON' on PATH (set PYTHON=/path/to/python)"
probe=$("$PYTHON" -c 'import jax' 2>&1) ||
  fail "jax cannot be imported by $(command -v "$PYTHON"): $(printf '%s\n' "$probe" | tail -n 1)"

wheels=${ACCELERATOR_CHECK_WHEELS:-.whl}
site=$(mkdir -p "${ACCELERATOR_CHECK_SITE:-.site}" && cd "${ACCELERATOR_CHECK_SITE:-.site}" && pwd) ||
  fail "cannot make ${ACCELERATOR_CHECK_SITE:-.site}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    log=$("$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
          "$wheels"/*.whl 2>&1)
  else  # no pip: a wheel is a zip of what goes on the path
    log=$(for w in "$wheels"/*.whl; do "$PYTHON" -m zipfile -e "$w" "$site" || exit 1; done 2>&1)
  fi || fail "the carried wheels ($wheels/) do not install: $(printf '%s\n' "$log" | tail -n 1)"
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ "${ACCELERATOR_CHECK_PLATFORM:-}" = cpu ]; then
  export JAX_PLATFORMS=cpu
else
  unset JAX_PLATFORMS  # jax reports every accelerator it has
fi
export OUT=${OUT:-$PWD/runs/accelerator_check}
mkdir -p "$OUT" || fail "cannot write to OUT=$OUT"

budget=${ACCELERATOR_CHECK_BUDGET:-470}
timeout --kill-after=10 $((${budget%.*} + 60)) "$PYTHON" -m experiments.accelerator_check "$@"
status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
  echo "accelerator_check: FAIL: killed after $((${budget%.*} + 60)) s; the rows that finished are in $OUT/accelerator_check.json"
fi
exit "$status"
