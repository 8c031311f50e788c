#!/usr/bin/env bash
# The carry folder .whl/ (ignored by git): wheels of what the device check needs that the GPU
# machine lacks (experiments/device_wheels.txt), for its Python (DEVICE_PYTHON_VERSION, default
# 3.12) on x86-64 Linux, fetched by pip from the package index. At most 64 MiB in all (checked).
#
#   bash experiments/device_wheels.sh [DEST]      # default DEST: .whl
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
python=${PYTHON:-python3}
version=${DEVICE_PYTHON_VERSION:-3.12}
limit=$((64 * 1024 * 1024))
rm -rf "$dest" && mkdir -p "$dest"
grep -v '^\s*\(#\|$\)' experiments/device_wheels.txt | while read -r requirement; do
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" "$requirement"
done
bytes=$(find "$dest" -type f -name "*.whl" -printf "%s\n" | awk "{s += \$1} END {print s + 0}")
count=$(find "$dest" -type f -name "*.whl" | wc -l)
echo "device_wheels: $count wheels, $bytes bytes in $dest"
if [ "$bytes" -gt "$limit" ]; then
  echo "device_wheels: FAIL: $dest holds $bytes bytes, over the 64 MiB a call carries"
  exit 1
fi
