# Every install step lives here: `make test` and `make demo` work on a fresh clone.
# torch is pinned so that the CPU wheel already on the machine is used.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The adapters' tests run against the real trainers: TRL 1.16 and verl 0.9.1 in one environment, as a user
# installs them (pyproject.toml's trl and verl extras own the pins). torch==2.13.0 beside them keeps pip from
# pulling another torch; verl goes in --no-deps, its extra holding what its loss path imports.
INTEGRATIONS := $(VENV)/.integrations
INTEGRATION_PINS := "transformers>=5.5.3,<5.11,!=5.6.0"  # the trl extra's, for the GPU wheels below
VERL_PIN := "verl>=0.9.1,<0.10"

.PHONY: setup swift test-envs test matrix lint peers demo list docs clean bench-gpu gpu-check gpu-wheels bench-step gpu-step-wheels

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

$(INTEGRATIONS): $(STAMP)
	$(PY) -m pip install --quiet torch==2.13.0 -e ".[dev,trl,verl]"
	$(PY) -m pip install --quiet --no-deps $(VERL_PIN)
	touch $(INTEGRATIONS)

# ms-swift's adapter (pgloss.integrations.swift) is tested inside ms-swift 4.6.0's own GRPOTrainer, which needs its
# own TRL (ms-swift 4.6.0 requires trl<1.0: 0.29.1 resolves, with transformers 5.19) beside the TRL 1.16 above: a
# venv of its own with pyproject.toml's swift extra (ms-swift, msgspec, pytest), torch==2.13.0 pinned so pip reuses
# the CPU wheel. tests/integrations/test_swift_env.py runs tests/integrations/swift_adapter in it (skipped where it
# is absent). About 2 minutes to build on 2 cores.
SWIFT_VENV := .venv-swift
SWIFT := $(SWIFT_VENV)/.installed
$(SWIFT): pyproject.toml
	rm -rf $(SWIFT_VENV)
	$(PYTHON) -m venv $(SWIFT_VENV)
	$(SWIFT_VENV)/bin/python -m pip install --quiet torch==2.13.0 -e ".[swift]"
	touch $@

swift: $(SWIFT)

# The parity tests read some trainers' loss code from their released source, without installing it
# (their package imports pull in whole training stacks, and torchrl 0.14 wants a tensordict that verl's pin
# above excludes): the wheels below, each unpacked into $(SOURCES)/<name> behind its own stamp, so that a
# checkout built before a source was added fetches it on its next `make test` (to change a version, delete
# that directory). SkyRL 0.4.0 requires Python >= 3.12, so its pure-Python wheel is fetched for 3.12; torchrl's
# wheels differ only in compiled parts, so one platform's is fetched everywhere. The sources not on the package
# index (prime-rl, verl-recipe, NeMo-RL, ...) are read when their PGLOSS_*_SRC is set, else those tests are skipped.
# `pgloss conformance` reads ms-swift's and OpenRLHF's losses from their files the same way (their packages import
# transformers, peft, deepspeed, ...); OpenRLHF's wheel keeps its files under openrlhf-<version>.data/purelib.
SOURCES := $(VENV)/sources
OPENRLHF_VERSION := 0.11.2
WHEEL_trinity := trinity-rft==0.6.0
WHEEL_tinker  := tinker-cookbook==0.6.1
WHEEL_torchrl := torchrl==0.14.1 --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all:
WHEEL_skyrl   := skyrl==0.4.0 --python-version 3.12 --only-binary=:all:
WHEEL_ms_swift := ms-swift==4.6.0
WHEEL_openrlhf := openrlhf==$(OPENRLHF_VERSION)
WHEEL_areal   := areal==1.0.4
TRAINER_SOURCES := $(foreach name,trinity tinker torchrl skyrl ms_swift openrlhf areal,$(SOURCES)/$(name)/.unpacked)
$(SOURCES)/%/.unpacked: | $(STAMP)
	rm -rf $(SOURCES)/$* $(SOURCES)/$*-wheel
	$(PY) -m pip download --quiet --no-deps $(WHEEL_$*) -d $(SOURCES)/$*-wheel
	$(PY) -m zipfile -e $(SOURCES)/$*-wheel/*.whl $(SOURCES)/$*
	touch $@

# Liger-Kernel's GRPO loss imports only torch and triton (the dev extra's): installed without its requirements.
LIGER := $(VENV)/.liger
LIGER_PIN := liger-kernel==0.8.5
$(LIGER): | $(STAMP)
	$(PY) -m pip install --quiet --no-deps $(LIGER_PIN)
	touch $@

# The environments `make test` needs, built side by side (ms-swift's venv is independent of the main one; the
# trainers' sources wait for the main venv's pip): on a fresh clone about 3 minutes instead of 5.
TEST_ENVS := $(STAMP) $(INTEGRATIONS) $(TRAINER_SOURCES) $(LIGER) $(SWIFT)
test-envs: $(TEST_ENVS)

test:
	$(MAKE) -j4 test-envs
	PGLOSS_TRINITY_SRC=$${PGLOSS_TRINITY_SRC:-$(SOURCES)/trinity} PGLOSS_TINKER_SRC=$${PGLOSS_TINKER_SRC:-$(SOURCES)/tinker} \
	PGLOSS_TORCHRL_SRC=$${PGLOSS_TORCHRL_SRC:-$(SOURCES)/torchrl} PGLOSS_SKYRL_SRC=$${PGLOSS_SKYRL_SRC:-$(SOURCES)/skyrl} \
	PGLOSS_MS_SWIFT_SRC=$${PGLOSS_MS_SWIFT_SRC:-$(SOURCES)/ms_swift} PGLOSS_AREAL_SRC=$${PGLOSS_AREAL_SRC:-$(SOURCES)/areal} \
	PGLOSS_OPENRLHF_SRC=$${PGLOSS_OPENRLHF_SRC:-$(SOURCES)/openrlhf/openrlhf-$(OPENRLHF_VERSION).data/purelib} \
	$(PY) -m pytest -n 2 --durations=15 tests

# The supported range, tested (`.ci/run` runs it after `make test`): the core, property and kernel-interpreter tests
# under the floor torch (pyproject.toml's, on the oldest Python pgloss supports) and under the newest torch release
# (on the newest Python here), each in its own venv in $(MATRIX)/ with only the `test` extra, as a user installs
# pgloss; tests/matrix.py prints one table (torch, Python, Triton, passed, failed). The floor is torch 2.9.1, the
# oldest the trainers pin today (AReaL 1.0.4: >= 2.9.1, < 2.11; verl 0.9.1's extras: 2.11.0; SkyRL 0.4: 2.13.0).
# Each venv holds a CUDA build of torch with its CUDA libraries (the package index has no CPU build for Linux
# x86-64; torch's libraries link them even on a CPU): about 3 GB to download and 6 GB on disk apiece, built once
# (delete the folder to rebuild). The machine's pip configuration caps torch below its newest release; the venvs'
# installs set PIP_CONSTRAINT to an empty file, which lifts that cap for those commands alone. Time on 2 cores:
# 25 minutes from an empty $(MATRIX) (building both venvs about 4 of them, the floor's tests 9.6 minutes and the
# newest's 11.5), measured with other test runs on the machine; with `make test`'s 15, within CI's 90.
MATRIX := .venv-matrix
MATRIX_FLOOR := 2.9.1
MATRIX_NEWEST := 2.15.0
MATRIX_PYTHON_$(MATRIX_FLOOR) := 3.10
MATRIX_PYTHON_$(MATRIX_NEWEST) := 3.13
MATRIX_TESTS := tests/core tests/properties tests/vocab/test_kernels.py tests/vocab/test_head_kernel.py \
	tests/vocab/test_kernel_inputs.py
MATRIX_ARGS ?= -n 2
# pythonX.Y where it runs (pyenv's shims answer only for the versions a machine enables, so pyenv's own
# installs are tried too), else $(PYTHON): the matrix then says which Python it ran on.
python_for = $(firstword $(foreach p,python$(1) $(wildcard $(HOME)/.pyenv/versions/$(1).*/bin/python$(1)),\
	$(shell $(p) -c 'print("$(p)")' 2>/dev/null)) $(PYTHON))
$(MATRIX)/torch-%/.installed: pyproject.toml
	rm -rf $(MATRIX)/torch-$*
	$(call python_for,$(MATRIX_PYTHON_$*)) -m venv $(MATRIX)/torch-$*
	echo > $(MATRIX)/no-constraints.txt
	PIP_CONSTRAINT=$(CURDIR)/$(MATRIX)/no-constraints.txt $(MATRIX)/torch-$*/bin/python -m pip install --quiet \
		torch==$* pytest-xdist -e ".[test]"
	touch $@

matrix: $(MATRIX)/torch-$(MATRIX_FLOOR)/.installed $(MATRIX)/torch-$(MATRIX_NEWEST)/.installed
	$(PYTHON) tests/matrix.py $(MATRIX)/torch-$(MATRIX_FLOOR) $(MATRIX)/torch-$(MATRIX_NEWEST) -- \
		$(MATRIX_ARGS) $(MATRIX_TESTS)

# The code's own checks (pyproject.toml configures them); `make test` runs them too (tests/test_lint.py).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

# The trainers' own loss tests (tests/peers/): swapped to pgloss (as in `make test`), then unmodified.
peers: $(STAMP) $(INTEGRATIONS)
	$(PY) -m pytest -q -rx tests/peers/verl
	PGLOSS_PEERS=original $(PY) -m pytest -q tests/peers/verl

# The GPU benchmark (benchmarks/gpu.py: every row printed and written to benchmarks/results/ as it is
# measured, about 8 minutes on one H100). It runs in the venv, or in any Python that has a CUDA torch:
# `make bench-gpu BENCH_PYTHON=python3` builds no venv, for a machine without network. The peers it lacks
# are installed first, offline, from $(GPU_WHEELS); BENCH_ARGS passes options (BENCH_ARGS="--device cpu --quick").
GPU_WHEELS := .gpu-wheels
BENCH_PYTHON ?=
bench-gpu: $(if $(BENCH_PYTHON),,$(STAMP))
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(or $(BENCH_PYTHON),$(PY)) benchmarks/gpu.py \
		--wheels $(GPU_WHEELS) $(BENCH_ARGS)

# What a GPU machine checks before it measures: the Triton kernels on CUDA against the float64 logits and
# compiled by its Triton (tests/vocab/test_kernels*.py), every loss call under CUDA's own host-sync check
# (tests/properties/test_no_host_sync.py, its cuda cases), then the benchmark. The same Python choice.
gpu-check: $(if $(BENCH_PYTHON),,$(STAMP))
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(or $(BENCH_PYTHON),$(PY)) -m pytest -q \
		-p no:cacheprovider -n 8 tests/vocab/test_kernels.py tests/vocab/test_kernels_compile.py
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(or $(BENCH_PYTHON),$(PY)) -m pytest -q \
		-p no:cacheprovider -n 8 tests/properties/test_no_host_sync.py -k cuda
	$(MAKE) bench-gpu

# The peers' wheels for a GPU machine without network, fetched once on a machine with it (then copy the
# folder across): for CPython 3.12 on manylinux x86-64 and for this machine's Python. The peers at the
# versions the tests use (verl without its requirements: its loss is read from its files), and what TRL
# needs beside torch and triton, which the GPU machine has: accelerate without its requirements (they would
# fetch torch), the rest with theirs. To fetch again, delete the folder.
GPU_PEERS := "trl>=1.16,<1.17" liger-kernel==0.8.5 cut-cross-entropy==25.1.1 $(VERL_PIN) accelerate
GPU_PEER_DEPS := "datasets>=4.7.0" $(INTEGRATION_PINS) psutil
GPU_PY312 := --python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	--platform manylinux1_x86_64
gpu-wheels: $(GPU_WHEELS)/.fetched
$(GPU_WHEELS)/.fetched:
	for target in "$(GPU_PY312)" ""; do \
		$(PYTHON) -m pip download --quiet --no-deps -d $(GPU_WHEELS) $$target $(GPU_PEERS) && \
		$(PYTHON) -m pip download --quiet -d $(GPU_WHEELS) $$target $(GPU_PEER_DEPS) || exit 1; \
	done
	touch $@

# The GRPO optimizer step users run (benchmarks/grpo_step.py): TRL 1.16's GRPOTrainer with its own loss, with
# Liger's kernels, and with pgloss's adapter plain and fused, on the Qwen2-0.5B and 1.5B shapes (random weights),
# completions from 1024 tokens doubling until memory runs out; about 330 s (--budget) on one GPU. What it needs
# beside torch and transformers is installed first, offline and without requirements, from $(GPU_WHEELS);
# the same Python choice as bench-gpu (BENCH_ARGS="--device cpu --quick": the command's own check on a CPU).
# benchmarks/gpu_step_check.sh is the same run as one command for a GPU machine without make or network.
bench-step: $(if $(BENCH_PYTHON),,$(STAMP))
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(or $(BENCH_PYTHON),$(PY)) benchmarks/grpo_step.py \
		--wheels $(GPU_WHEELS) $(BENCH_ARGS)

# Only what a GPU image with torch, triton, transformers, accelerate, pyarrow and pandas lacks, for CPython 3.12
# (all pure Python, about 4.5 MB): TRL, Liger-Kernel, and datasets (which TRL imports) with the two requirements
# such an image lacks, for the step; Cut Cross-Entropy and verl (its loss is read from its files) for the rest of
# benchmarks/gpu_session.sh. datasets 5.0.0 is the newest that accepts pyarrow 21 (5.2 asks for 24).
STEP_WHEELS := trl==1.16.0 liger-kernel==0.8.5 datasets==5.0.0 dill==0.4.1 multiprocess==0.70.19 \
	cut-cross-entropy==25.1.1 verl==0.9.1
gpu-step-wheels:
	$(PYTHON) -m pip download --quiet --no-deps -d $(GPU_WHEELS) $(GPU_PY312) $(STEP_WHEELS)

demo: $(STAMP)
	$(VENV)/bin/pgloss losses
	$(VENV)/bin/pgloss compare

list: $(STAMP)
	$(VENV)/bin/pgloss list

# The documentation site (mkdocs.yml: the guides in docs/ and the API reference from the docstrings), served at
# http://127.0.0.1:8000 with live reload. `make test` builds it with --strict (tests/test_docs_site.py).
docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

clean:
	rm -rf $(VENV) $(MATRIX) $(SWIFT_VENV) build src/*.egg-info
