# Thin wrapper over CMake presets. Every target installs what is missing first (scripts/bootstrap.sh).
JOBS ?= $(shell nproc)
FUZZ_SECONDS ?= 60
SHORT_FUZZ_SECONDS ?= 20
GPUIPC := build/bin/gpuipc

SOAK_SECONDS ?= 600

.PHONY: all deps build demo test wheel gpu-test soak bench study asan tsan fuzz fuzz-build fuzz-short format tidy clean

all: build

deps:
	@scripts/bootstrap.sh

build: deps
	cmake --preset default >/dev/null
	cmake --build --preset default -j $(JOBS)

## The main job: a producer and a consumer process stream frames through a channel (see README).
demo: build
	$(GPUIPC) demo

## CPU test suite (GPU tests skip with their reason where there is no GPU) plus a short fuzz run.
test: build
	ctest --preset default
	$(MAKE) --no-print-directory fuzz-short
	@# The Python module (python/): the sdist and the manylinux wheel built from it (incrementally, in build-py/sdist/),
	@# installed into a fresh virtual environment where tests/python runs, with python -m gpuipc's checks.
	scripts/build_wheel.sh build-py/ci
	tests/package/check_wheel.sh build-py/ci

## The Python distributions in build-py/wheelhouse: the manylinux wheel and the sdist (docs/install.md#python).
## PYTHON=python3.12 (or later) for the cp312-abi3 wheel that the GPU machine's Python takes.
wheel: deps
	scripts/build_wheel.sh

## The gpu-labelled tests, for a machine with a GPU.
gpu-test: build
	ctest --preset gpu

## The kill storm for SOAK_SECONDS (default 10 minutes) each on a host channel (tests/integration/test_kill_storm.cpp)
## and on a device channel (tests/gpu/test_kill_storm_device.cpp; it skips, saying why, without a GPU, and is not
## built without nvcc): 4 producers and 4 consumers, a random one SIGKILLed and restarted every 50-200 ms.
## GPUIPC_STORM_SEED=<n> replays a seed.
soak: build
	GPUIPC_STORM_SECONDS=$(SOAK_SECONDS) build/tests/integration_test_kill_storm --gtest_color=no
	if [ -x build/tests/gpu_test_kill_storm_device ]; then \
	  GPUIPC_STORM_SECONDS=$(SOAK_SECONDS) build/tests/gpu_test_kill_storm_device --gtest_color=no; \
	else echo "soak: no device-channel storm (built without nvcc)"; fi

## Benchmarks; JSON lands in bench/results/ (see docs/benchmarks.md).
bench: build
	scripts/run_bench.sh

## The CUDA IPC study (docs/study.md) from the result files in bench/results/: plots (docs/img), then the page; and
## the README's table of figures (bench/analysis/readme_table.py).
## Needs python3 with matplotlib; run the benchmarks first (gpuipc bench all) on a GPU machine.
study:
	python3 bench/analysis/plot.py bench/results --out docs/img
	python3 bench/analysis/study.py bench/results --img docs/img --out docs/study.md
	python3 bench/analysis/readme_table.py

## ASan + UBSan build of the CPU test suite.
asan: deps
	cmake --preset asan >/dev/null
	cmake --build --preset asan -j $(JOBS)
	ctest --preset asan

## TSan build of the CPU test suite.
tsan: deps
	cmake --preset tsan >/dev/null
	cmake --build --preset tsan -j $(JOBS)
	ctest --preset tsan

fuzz-build: deps
	cmake --preset fuzz >/dev/null
	cmake --build --preset fuzz -j $(JOBS) --target fuzz_proto_decode fuzz_block_ref fuzz_shm fuzz_broker

## The fuzzers (wire protocol, BlockRef decoding, shared control blocks, broker state) under libFuzzer + ASan, FUZZ_SECONDS (default 60) each.
fuzz: fuzz-build
	scripts/fuzz.sh $(FUZZ_SECONDS)

fuzz-short: fuzz-build
	scripts/fuzz.sh $(SHORT_FUZZ_SECONDS)

format:
	@scripts/bootstrap.sh clang-format
	git ls-files '*.cpp' '*.hpp' '*.cu' | xargs clang-format -i

tidy: build
	@scripts/bootstrap.sh clang-tidy
	git ls-files 'src/*.cpp' | xargs clang-tidy -p build --quiet

clean:
	rm -rf build build-asan build-tsan build-fuzz
