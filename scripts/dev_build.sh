#!/usr/bin/env bash
# Developer build: compiles awex_fast._C into build/dev and copies it next to the Python sources,
# so that a venv with this checkout on its path (see README, "Developing") imports it in place.
# AWEX_FAST_CUDA defaults to OFF here because nvcc makes every rebuild slow; set it to AUTO or ON
# to check the CUDA sources compile.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${AWEX_FAST_CUDA:-OFF}"
dir="build/dev-${mode,,}"
cmake -S . -B "$dir" -G Ninja -DAWEX_FAST_CUDA="$mode" -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v python)" \
  -Dpybind11_DIR="$(python -m pybind11 --cmakedir)" \
  -DSKBUILD_PROJECT_VERSION="$(python -c 'import tomllib;print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')" >/dev/null
cmake --build "$dir" -j "${JOBS:-2}"
if [ "${NO_INSTALL:-0}" = 1 ]; then
  echo "built $(ls "$dir"/_C*.so) (AWEX_FAST_CUDA=$mode), not copied"
else
  # Replace atomically (new inode): overwriting in place would corrupt the code pages of any
  # running process that has the old extension mapped.
  so=$(basename "$dir"/_C*.so)
  cp "$dir/$so" "awex_fast/.$so.tmp" && mv -f "awex_fast/.$so.tmp" "awex_fast/$so"
  echo "built $(ls awex_fast/_C*.so) (AWEX_FAST_CUDA=$mode)"
fi
