#!/usr/bin/env bash
# Installs what building and testing gpuipc needs, or says exactly what is missing and how to get it.
# Debian/Ubuntu packages; run as root (or with sudo available) to install, otherwise it only reports.
#   scripts/bootstrap.sh             what building and testing need (make's `deps`)
#   scripts/bootstrap.sh PACKAGE...  only these, for a target that needs a tool of its own (make format: clang-format,
#                                    make tidy: clang-tidy), so that the build and `make test` do not wait for them
set -euo pipefail

if [ $# -gt 0 ]; then
  packages=("$@")
else
  packages=(cmake make g++ pkg-config libgtest-dev libgmock-dev libbenchmark-dev libfmt-dev libcli11-dev
            nlohmann-json3-dev clang libclang-rt-14-dev python3-venv)
fi
# python3-venv only matters where python3 is Debian's own.
missing=()
for p in "${packages[@]}"; do
  if [ "$p" = python3-venv ] && python3 -c 'import venv, ensurepip' 2>/dev/null; then continue; fi
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

# The CUDA headers (cuda.h) are needed to build; the driver is not (it is loaded at run time). A tool alone
# (clang-format) needs neither.
cuda_ok=0
for d in "${CUDA_HOME:-}/include" /usr/local/cuda/include /usr/include; do
  [ -f "$d/cuda.h" ] && cuda_ok=1
done
if [ $cuda_ok -eq 0 ] && [ $# -eq 0 ]; then
  echo "gpuipc needs the CUDA toolkit's headers (cuda.h) to build, and nvcc for its GPU kernels." >&2
  echo "Install the CUDA toolkit (NVIDIA's packages, or Debian's nvidia-cuda-toolkit from non-free)," >&2
  echo "or point CUDA_HOME at an installed one. No GPU or driver is needed to build." >&2
  exit 1
fi

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "gpuipc needs these Debian/Ubuntu packages (or their equivalents): ${missing[*]}" >&2
  exit 1
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo="sudo"
  else
    echo "gpuipc needs packages that are not installed: ${missing[*]}" >&2
    echo "Install them with:  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi

echo "Installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
