#!/usr/bin/env bash
# The Python distributions that scripts/build_wheel.sh made, checked as a user gets them (`make test` runs this
# after `scripts/build_wheel.sh build-py/ci`):
#   [PYTHON=python3] tests/package/check_wheel.sh DIR [pytest args]
# DIR holds gpuipc-*-manylinux_*.whl (built from the sdist) and gpuipc-*.tar.gz. PYTHON must be the interpreter
# the wheel was built with.
#  1. The wheel: auditwheel confirms its manylinux tag; it carries an executable gpuipcd; no libcuda and no grafted
#     library is inside; gpuipcd and the extension need only glibc, libstdc++ and libgcc_s.
#  2. The sdist: every file git tracks is in it, but bench/results (pyproject.toml's sdist.exclude). The wheel was
#     built from it, so it also builds.
#  3. A fresh virtual environment (made for each run, under /tmp) installs the wheel and its dependencies without an
#     index, from build-py/pydeps-cpXY (numpy, and pytest and nanobind for the tests: downloaded from PyPI once,
#     kept); `python -m gpuipc doctor`, `ls` and `stat` run there against the wheel's gpuipcd; then pytest runs
#     tests/python against the installed wheel (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:?usage: check_wheel.sh DIR [pytest args]}
shift
python=${PYTHON:-python3}
cp=$("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
env=build-py/env-$cp  # scripts/build_wheel.sh's tools (auditwheel)
fail() { echo "check_wheel: $*" >&2; exit 1; }

wheels=("$dir"/gpuipc-*-manylinux_*.whl)
sdists=("$dir"/gpuipc-*.tar.gz)
[ ${#wheels[@]} -eq 1 ] && [ -f "${wheels[0]}" ] || fail "want one manylinux wheel in $dir, found: ${wheels[*]}"
[ ${#sdists[@]} -eq 1 ] && [ -f "${sdists[0]}" ] || fail "want one sdist in $dir, found: ${sdists[*]}"
wheel=$(realpath "${wheels[0]}")
sdist=$(realpath "${sdists[0]}")
plat=${wheel##*-}
plat=${plat%.whl}
echo "== $(basename "$wheel") ($plat), $(basename "$sdist")"

tmp=$(mktemp -d /tmp/gpi-wheel-XXXXXX)  # short: the broker's socket path must fit in 108 bytes
cleanup() {
  if [ -f "$tmp/rt/broker.pid" ]; then kill "$(cat "$tmp/rt/broker.pid")" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT

# 1. The wheel's contents and the libraries its ELF files need.
"$env/bin/auditwheel" show "$wheel" > "$tmp/show.txt" 2>&1 || { cat "$tmp/show.txt"; fail "auditwheel show failed"; }
tr -s ' \n' ' ' < "$tmp/show.txt" | grep -q "consistent with the following platform tag: \"$plat\"" ||
  { cat "$tmp/show.txt"; fail "auditwheel does not confirm $plat"; }
"$python" - "$wheel" "$tmp/unpacked" <<'EOF' || fail "no executable gpuipc/gpuipcd in the wheel"
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2])
    sys.exit(0 if z.getinfo("gpuipc/gpuipcd").external_attr >> 16 & 0o111 else 1)
EOF
extra=$(find "$tmp/unpacked" -name 'libcuda*' -o -name '*.libs')
[ -z "$extra" ] || fail "the wheel carries libcuda or grafted libraries: $extra"
for f in "$tmp/unpacked/gpuipc/gpuipcd" "$tmp"/unpacked/gpuipc/_gpuipc*.so; do
  needed=$(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
  for lib in $needed; do
    case "$lib" in
      libc.so.6 | libm.so.6 | ld-linux-x86-64.so.2 | libstdc++.so.6 | libgcc_s.so.1) ;;
      *) fail "$(basename "$f") needs $lib, which a manylinux system need not have" ;;
    esac
  done
  echo "$(basename "$f") needs: $needed"
done

# 2. The sdist holds what git tracks.
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  top=$(basename "$sdist" .tar.gz)  # the sdist's top folder, gpuipc-<version>
  missing=$(comm -23 <(git ls-files | grep -v '^bench/results/' | sort) \
                     <(tar tzf "$sdist" | sed "s|^$top/||" | sort))
  [ -z "$missing" ] || fail "tracked files missing from the sdist: $missing"
  echo "sdist: every tracked file (but bench/results)"
fi

# 3. A fresh virtual environment with the wheel, offline.
deps=build-py/pydeps-$cp
want="numpy pytest nanobind==3.1.0"  # nanobind: tests/python/test_stubs.py runs its stubgen
"$python" -m venv "$tmp/venv"
py=$tmp/venv/bin/python
if [ "$(cat "$deps/.want" 2>/dev/null)" != "$want" ]; then
  rm -rf "$deps"
  "$py" -m pip download -q --only-binary :all: -d "$deps" $want
  echo "$want" > "$deps/.want"
fi
"$py" -m pip install -q --no-index --find-links "$deps" "$wheel" $want
"$py" -m pip check
(cd "$tmp" && "$py" -c 'import gpuipc, sys; assert gpuipc.__file__.startswith(sys.prefix), gpuipc.__file__')

mkdir -m 0755 "$tmp/rt"
export GPUIPC_RUNTIME_DIR=$tmp/rt
(cd "$tmp" && "$py" -m gpuipc doctor) || fail "python -m gpuipc doctor failed"
(cd "$tmp" && "$py" -m gpuipc doctor --json > "$tmp/doctor.json") || fail "python -m gpuipc doctor --json failed"
"$py" - "$tmp/doctor.json" "$tmp/venv" <<'EOF'
import json, os, sys
r = json.load(open(sys.argv[1]))
venv = os.path.realpath(sys.argv[2])
assert r["ok"] and r["broker"]["reachable"], r
assert os.path.realpath(r["daemon"]).startswith(venv), f"daemon {r['daemon']} is not the wheel's"
exe = os.path.realpath(f"/proc/{r['broker']['pid']}/exe")
assert exe.startswith(venv) and exe.endswith("/gpuipc/gpuipcd"), f"the broker runs {exe}, not the wheel's gpuipcd"
print(f"doctor: broker pid {r['broker']['pid']} runs {exe}")
EOF
(cd "$tmp" && "$py" -c 'import gpuipc; gpuipc.Segment.create("check-wheel", 4096, kind="host").close()')
listing=$(cd "$tmp" && "$py" -m gpuipc ls)
grep -q '^check-wheel ' <<< "$listing" || fail "python -m gpuipc ls does not list check-wheel: $listing"
listing=$(cd "$tmp" && "$py" -m gpuipc stat --json check-wheel)
grep -q '"size": 4096' <<< "$listing" || fail "python -m gpuipc stat --json check-wheel: $listing"
(cd "$tmp" && "$py" -c 'import gpuipc; gpuipc.Segment.unlink("check-wheel")')
listing=$(cd "$tmp" && "$py" -m gpuipc ls --json)
[ "$listing" = "[]" ] || fail "python -m gpuipc ls --json after the unlink: $listing"
kill "$(cat "$tmp/rt/broker.pid")"
unset GPUIPC_RUNTIME_DIR
echo "python -m gpuipc doctor, ls, stat: ok"

"$py" -m pytest -p no:cacheprovider tests/python -q "$@"
