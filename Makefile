# Convenience targets. The package itself is built by setup.py (`pip install .`); this file drives
# the README commands, the sanitized C unit tests and the benchmarks.
#
#   make demo        the main job, python -m llmmem compare (see README), setting up the environment first;
#                    COMPARE_ARGS="--quick" for the small version CI runs
#   make test        the whole test suite (lint, C tests under ASan+UBSan, pytest), set-up included
#   make test TORCH=2.5.1   the same against another torch, in its own environment (see below)
#   make lint        ruff (lint + format check) and clang-format --dry-run; make format fixes
#   make test-c      only the C unit tests, built with the system compiler, no Python involved
#   make bench       the CPU benchmarks (JSON under benchmarks/results/)
#   make fuzz-pool   libFuzzer on the pool's C API for FUZZ_SECONDS (default 30), clang needed
#   make fuzz-args   libFuzzer on the binding's argument parsers: FUZZ_ARGS_RUNS inputs from a fixed
#                    seed (bounded, as the test suite runs it), or FUZZ_ARGS_SECONDS=N for a timed run
#   make clean

SHELL := /bin/bash
# `make test TORCH=2.5.1`: the same commands in an environment of their own with that torch (the
# oldest pyproject.toml promises), beside the pinned one, which CI keeps using.
ifdef TORCH
LLMMEM_VENV := $(HOME)/.cache/llmmem-venv-torch$(TORCH)
export LLMMEM_TORCH_VERSION := $(TORCH)
endif
LLMMEM_VENV ?= $(HOME)/.cache/llmmem-venv
export LLMMEM_VENV
PY := $(LLMMEM_VENV)/bin/python
CC ?= cc

# The C tests link the C core built from source with the CPU stand-ins for the CUDA part, and the
# binding's argument parsers (plain C, no Python: csrc/python/args.c).
CORE_SRC := $(filter-out csrc/python/%,$(wildcard csrc/*/*.c)) csrc/python/args.c
CORE_HDR := $(wildcard csrc/include/llmmem/*.h csrc/*/*.h tests/c/*.h)
CTEST_SRC := $(wildcard tests/c/test_*.c)
CTEST_BIN := $(patsubst tests/c/%.c,build/ctests/%,$(CTEST_SRC))
CTEST_CFLAGS := -std=c11 -g -O1 -Wall -Wextra -Werror -Wno-missing-field-initializers -pthread -fno-math-errno -fno-trapping-math -ffp-contract=off \
  -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer \
  -DLLMMEM_DEBUG=3 -Icsrc/include -Icsrc/common -Itests/c
# The core is compiled once per build flavour (gcc, clang, gcc -O3) into objects that every test
# program of that flavour links, rather than once per program: the sanitized build of the core is
# what takes the time.
CORE_OBJ = $(patsubst %.c,build/ctests/obj/$(1)/%.o,$(CORE_SRC))

build/ctests/obj/gcc/%.o: %.c $(CORE_HDR)
	@mkdir -p $(dir $@)
	$(CC) $(CTEST_CFLAGS) -c $< -o $@

build/ctests/obj/clang/%.o: %.c $(CORE_HDR)
	@mkdir -p $(dir $@)
	$(CLANG) $(CTEST_CFLAGS) -c $< -o $@

build/ctests/obj/O3/%.o: %.c $(CORE_HDR)
	@mkdir -p $(dir $@)
	$(CC) $(CTEST_CFLAGS) -O3 -c $< -o $@

# lsan is not usable under some sandboxes' ptrace rules; leaks are still checked where it works.
export ASAN_OPTIONS ?= detect_leaks=1:abort_on_error=0
export UBSAN_OPTIONS ?= print_stacktrace=1

.PHONY: demo test test-c c-tests env bench clean fuzz-pool fuzz-args lint format

env:
	@bash scripts/setup_env.sh

# Every memory technique on one GPT, each in a fresh process: table, results.json/.md and two charts
# in ./llmmem-compare (about 3 minutes on 2 idle cores; --quick about 1).
# The console script, not `python -m`, keeps the checkout off sys.path: the installed llmmem runs.
COMPARE_ARGS ?=
demo: env
	$(LLMMEM_VENV)/bin/llmmem compare $(COMPARE_ARGS)

# pytest builds and runs the C tests too (tests/test_c_core.py), so this is the one test command.
# The pytest script (not `python -m pytest`) keeps the checkout off sys.path: the installed llmmem is tested.
# The test files are spread over one worker a core (at most 4: many tests start ranks of their own),
# each file on one worker, so that a file's module-scoped set-up (the C tests' build) runs once.
# PYTEST_ARGS= runs them in one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
PYTEST_ARGS ?= -n $(TEST_WORKERS) --dist loadfile
test: env lint
	$(LLMMEM_VENV)/bin/pytest $(PYTEST_ARGS)

# Style is checked, never fixed, by the test command: ruff (lint + format) on Python, clang-format
# on C/CUDA. `make format` fixes what it can.
C_FORMATTED = $(shell git ls-files 'csrc/*.c' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' 'tests/c/*.c' 'tests/c/*.h' \
  'tests/c/*.cc' 'tests/fuzz/*.c' 'benchmarks/*.c' 'benchmarks/*.h' 2>/dev/null)
CLANG_FORMAT ?= $(shell command -v clang-format 2>/dev/null)

lint: env
	$(LLMMEM_VENV)/bin/ruff check --no-cache .
	$(LLMMEM_VENV)/bin/ruff format --no-cache --check .
ifneq ($(CLANG_FORMAT),)
	$(CLANG_FORMAT) --dry-run --Werror $(C_FORMATTED)
else
	@echo "lint: clang-format not found; C formatting not checked (Debian: apt-get install clang-format)"
endif

format: env
	$(LLMMEM_VENV)/bin/ruff check --no-cache --fix .
	$(LLMMEM_VENV)/bin/ruff format --no-cache .
	$(if $(CLANG_FORMAT),$(CLANG_FORMAT) -i $(C_FORMATTED))

# The CUDA VMM backend is also tested without a GPU: compiled as host C++ against the CUDA headers
# (types only) and driven over a simulated driver (tests/c/test_pool_vmm.cc). Needs cuda.h.
CXX ?= c++
CUDA_INC ?= $(or $(CUDA_HOME),/usr/local/cuda)/include
CTEST_CXXFLAGS := $(subst -std=c11,-std=c++17,$(CTEST_CFLAGS)) -I$(CUDA_INC)
ifneq ($(wildcard $(CUDA_INC)/cuda.h),)
CTEST_BIN += build/ctests/test_pool_vmm
endif
VMM_TEST_OBJ := $(filter-out %/backend_cuda_stub.o,$(call CORE_OBJ,gcc))

build/ctests/test_pool_vmm: tests/c/test_pool_vmm.cc csrc/pool/backend_cuda_vmm.cu csrc/pool/backend_cuda_internal.h $(VMM_TEST_OBJ) $(CORE_HDR)
	$(CXX) $(CTEST_CXXFLAGS) -o $@ tests/c/test_pool_vmm.cc -x c++ csrc/pool/backend_cuda_vmm.cu -x none $(VMM_TEST_OBJ) -lm -ldl

# Where clang is installed, the plain C tests are built with it too: its UBSan checks more than
# gcc's (arithmetic on a NULL pointer, for one, which gcc's build let through in the scaler).
CLANG ?= $(shell command -v clang 2>/dev/null)
ifneq ($(CLANG),)
CTEST_BIN += $(patsubst tests/c/%.c,build/ctests/clang/%,$(filter-out %_openmp.c,$(CTEST_SRC)))
endif

build/ctests/clang/%: tests/c/%.c $(call CORE_OBJ,clang) $(CORE_HDR)
	@mkdir -p $(dir $@)
	$(CLANG) $(CTEST_CFLAGS) -o $@ $< $(call CORE_OBJ,clang) -lm -ldl

# Tests of vector loops again at -O3, the release build's level: at -O1 the compiler does not
# vectorise, so only these compare the vector code the package ships with the references.
CTEST_O3 := test_optim test_head
CTEST_BIN += $(addprefix build/ctests/O3/,$(CTEST_O3))

build/ctests/O3/%: tests/c/%.c $(call CORE_OBJ,O3) $(CORE_HDR)
	@mkdir -p $(dir $@)
	$(CC) $(CTEST_CFLAGS) -O3 -o $@ $< $(call CORE_OBJ,O3) -lm -ldl

c-tests: $(CTEST_BIN)

# The scaler's tests again with an OpenMP runtime linked in, as in a torch process (see the file);
# a compiler without OpenMP builds them plain.
HASH := \#
OPENMP_FLAG = $(shell printf '$(HASH)include <omp.h>\nint main(void){return omp_get_max_threads() < 1;}\n' | \
  $(CC) -fopenmp -x c - -o /dev/null 2>/dev/null && echo -fopenmp)
build/ctests/test_amp_openmp: tests/c/test_amp_openmp.c tests/c/test_amp.c $(CORE_SRC) $(CORE_HDR)
	@mkdir -p $(dir $@)
	$(CC) $(CTEST_CFLAGS) $(OPENMP_FLAG) -o $@ $< $(CORE_SRC) -lm -ldl

build/ctests/%: tests/c/%.c $(call CORE_OBJ,gcc) $(CORE_HDR)
	@mkdir -p $(dir $@)
	$(CC) $(CTEST_CFLAGS) -o $@ $< $(call CORE_OBJ,gcc) -lm -ldl

test-c: c-tests
	@set -e; for t in $(CTEST_BIN); do echo "== $$t"; $$t; done

FUZZ_CC ?= clang
FUZZ_SECONDS ?= 30

build/fuzz/fuzz_pool: tests/fuzz/fuzz_pool.c $(CORE_SRC) $(CORE_HDR)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
	  -DLLMMEM_DEBUG=3 -Icsrc/include -Icsrc/common -o $@ $< $(CORE_SRC) -lm -ldl

fuzz-pool: build/fuzz/fuzz_pool
	@mkdir -p build/fuzz/corpus-pool
	build/fuzz/fuzz_pool -max_total_time=$(FUZZ_SECONDS) -max_len=512 -rss_limit_mb=4096 \
	  -artifact_prefix=build/fuzz/ build/fuzz/corpus-pool

FUZZ_ARGS_RUNS ?= 30000
FUZZ_ARGS_SECONDS ?=

build/fuzz/fuzz_args: tests/fuzz/fuzz_args.c $(CORE_SRC) $(CORE_HDR)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
	  -DLLMMEM_DEBUG=3 -Icsrc/include -Icsrc/common -o $@ $< $(CORE_SRC) -lm -ldl

# Without FUZZ_ARGS_SECONDS: a fixed number of inputs from a fixed seed and no saved corpus, so
# every run (CI's included) tries the same inputs in the same bounded time.
fuzz-args: build/fuzz/fuzz_args
ifeq ($(FUZZ_ARGS_SECONDS),)
	build/fuzz/fuzz_args -runs=$(FUZZ_ARGS_RUNS) -seed=1 -max_len=2048 -rss_limit_mb=2048 \
	  -artifact_prefix=build/fuzz/
else
	@mkdir -p build/fuzz/corpus-args
	build/fuzz/fuzz_args -max_total_time=$(FUZZ_ARGS_SECONDS) -max_len=2048 -rss_limit_mb=2048 \
	  -artifact_prefix=build/fuzz/ build/fuzz/corpus-args
endif

bench: env
	$(PY) benchmarks/run.py --device cpu

clean:
	rm -rf build dist *.egg-info llmmem/_C*.so benchmarks/results
