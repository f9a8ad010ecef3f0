# Everything sets itself up on a fresh machine with Python 3 and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The other end of the supported Triton range (setup.py): the static gate runs under it too.
VENV36 := .venv-triton36
STAMP36 := $(VENV36)/.installed
# The CPU build of torch; any torch >= 2.11 works (setup.py), this one is what CI runs.
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.9.0
TRITON36_SPEC ?= triton==3.6.0
NVSHMEM_SPEC ?= nvidia-nvshmem-cu13==3.4.5
# Compiled kernels (Triton, csrc/) are cached by source hash outside the checkout, so a fresh
# clone on the same machine does not compile them again.
export TRITON_CACHE_DIR ?= $(HOME)/.cache/moe_comm/triton
export MOE_COMM_CACHE_DIR ?= $(HOME)/.cache/moe_comm
export TRITON_DEFAULT_FP_FUSION ?= 1

.PHONY: gpu-wheels bench host-cost test test-quick mutants gpu-gate gpu-gate-triton36 lint clean

$(STAMP): setup.py pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)" "$(TRITON_SPEC)"
	$(BIN)/pip install -q -e ".[test,megatron,deepspeed]"
	touch $(STAMP)

$(STAMP36): setup.py pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV36)
	$(VENV36)/bin/pip install -q "$(TORCH_SPEC)" "$(TRITON36_SPEC)" numpy "$(NVSHMEM_SPEC)"
	$(VENV36)/bin/pip install -q --no-deps -e .
	touch $(STAMP36)

gpu-wheels:  ## wheels gpu_check.sh installs on the GPU machine (Python 3.12): nvshmem4py, NIXL
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_17_x86_64 -d .whl "nvshmem4py-cu13==0.4.1"
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 -d .whl "nixl-cu13==1.5.1"

bench: $(STAMP)  ## the dispatch/combine benchmark on 4 CPU ranks, one table
	$(BIN)/python bench/dispatch_bench.py --ranks 4

host-cost: $(STAMP)  ## launches, aten calls, allocations, Python calls per op (GPU flavour, meta)
	$(BIN)/python bench/host_cost.py

test: $(STAMP) $(STAMP36)  ## the whole suite (CI), then the static gate under Triton 3.6
	$(BIN)/python -m pytest -q
	$(MAKE) gpu-gate-triton36

test-quick: $(STAMP)  ## the suite without the cases marked slow
	$(BIN)/python -m pytest -q -m "not slow"

mutants: $(STAMP)  ## one-line mutations of the product, each caught by its tests (not in test)
	$(BIN)/python tests/mutants.py

gpu-gate: $(STAMP)  ## every kernel as launched on a GPU, compiled for sm_90/sm_100 and read
	TRITON_INTERPRET=0 $(BIN)/python -m moe_comm.gate --arch 90 100

gpu-gate-triton36: $(STAMP36)  ## the same gate under Triton 3.6 (sm_90, DeepSeek-V3 sizes)
	TRITON_INTERPRET=0 $(VENV36)/bin/python -m moe_comm.gate --arch 90 \
		--config dsv3-prefill dsv3-decode --out bench/results/gpu_gate_triton36.tsv

lint: $(STAMP)
	$(BIN)/pip install -q ruff
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(VENV36) .pytest_cache bench/results *.egg-info
