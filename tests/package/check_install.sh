#!/usr/bin/env bash
# Installs the build tree into a fresh prefix (cmake --install) and uses it as a project outside the tree would:
# checks what libgpuipc.so exports (nm -D), builds tests/package/consumer with find_package(gpuipc) (shared and
# static) and with pkg-config, and runs each against its own broker, the gpuipcd of the prefix (host kinds only).
#   tests/package/check_install.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
work=$(mktemp -d /tmp/gpuipc-install.XXXXXX)
cleanup() {
  for dir in run-shared run-static run-pc; do
    GPUIPC_RUNTIME_DIR=$work/$dir "$work/prefix/bin/gpuipc" daemon --stop >/dev/null 2>&1 || true
  done
  rm -rf "$work"
}
trap cleanup EXIT
unset GPUIPC_DAEMON  # the library must find the prefix's own gpuipcd (lib/../bin)

prefix=$work/prefix
for component in runtime dev; do cmake --install "$build" --prefix "$prefix" --component "$component" >/dev/null; done
so=$(find "$prefix" -name 'libgpuipc.so.*.*.*' -type f | head -n 1)
[ -n "$so" ] || { echo "no libgpuipc.so.X.Y.Z under $prefix" >&2; exit 1; }
libdir=$(dirname "$so")
echo "installed: $(cd "$prefix" && find . -type f | sort | tr '\n' ' ')"
soname=$(objdump -p "$so" | awk '/SONAME/ {print $2}')
echo "SONAME: $soname"
[[ "$soname" == libgpuipc.so.* ]] || { echo "no SONAME libgpuipc.so.*" >&2; exit 1; }

# Only the public API is exported: every defined dynamic symbol is in namespace gpuipc (its type info and vtables
# too) and none is of a layer under the API, fmt or the C++ runtime.
exports=$(nm -D --defined-only "$so" | awk '{print $3}' | c++filt)
bad=$(echo "$exports" | grep -v -E '^(gpuipc::[A-Z]|gpuipc::(to_string|share|holders|heartbeat|encode_block_ref|decode_block_ref|version|protocol_version|human_bytes|log_level|set_log_level|runtime_dir|socket_path|ensure_runtime_dir|daemon_path|broker_listening|broker_info|stop_broker|client_pid|program_path|exec_program|driver_available|driver_info|format_driver_version|device_count|device_info|device_of|peer_access_matrix|device_ordinal|topology|copy_synchronous|mps_[a-z_]+)(\[abi:cxx11\])?\(|(typeinfo|typeinfo name|vtable) for gpuipc::[A-Z]|GPUIPC_0$)' || true)
if [ -n "$bad" ]; then
  echo "libgpuipc.so exports symbols outside the public API:" >&2
  echo "$bad" | head -n 20 >&2
  exit 1
fi
for must in 'gpuipc::Segment::create' 'gpuipc::Channel::send' 'typeinfo for gpuipc::Error' 'gpuipc::version()'; do
  [[ "$exports" == *"$must"* ]] || { echo "libgpuipc.so does not export $must" >&2; exit 1; }
done
echo "exports: $(echo "$exports" | wc -l) symbols, all of the public API"

cmake -S "$src/tests/package/consumer" -B "$work/cmake" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$work/cmake" >/dev/null
# Each run on a runtime directory of its own, so that it starts its own broker, with a PATH that holds no gpuipcd:
# the shared library must find the prefix's (lib/../bin); a static program is told where it is.
run() {  # run RUNTIME_SUBDIR PROGRAM ARGS...
  local dir=$1
  shift
  GPUIPC_RUNTIME_DIR=$work/$dir PATH=/usr/bin:/bin "$@"
  GPUIPC_RUNTIME_DIR=$work/$dir "$prefix/bin/gpuipc" daemon --stop >/dev/null
}
run run-shared "$work/cmake/consumer" "find_package, shared"
run run-static env GPUIPC_DAEMON="$prefix/bin/gpuipcd" "$work/cmake/consumer_static" "find_package, static"
loaded=$(ldd "$work/cmake/consumer")  # (not piped into grep -q: ldd's SIGPIPE would fail the pipeline)
[[ "$loaded" == *"$libdir/libgpuipc.so"* ]] || { echo "consumer does not load $libdir's libgpuipc.so: $loaded" >&2; exit 1; }

export PKG_CONFIG_PATH=$libdir/pkgconfig
# shellcheck disable=SC2046
c++ -std=c++20 -o "$work/pc_consumer" "$src/tests/package/consumer/main.cpp" $(pkg-config --cflags --libs gpuipc) \
  -Wl,-rpath,"$(pkg-config --variable=libdir gpuipc)"
run run-pc "$work/pc_consumer" "pkg-config $(pkg-config --modversion gpuipc)"
