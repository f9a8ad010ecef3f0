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
# vLLM 0.33.0 pins torch 2.14.0 (PyPI's is the CUDA 13 build; it runs on CPU) and triton 3.8.0:
# its DeepEP prepare/finalize run in their own environment (make test-vllm, not part of test:
# about 4 minutes and 6.6 GB to build). vLLM goes in without its dependencies; these are what
# the import chain of its DeepEP modules needs, nothing else.
VENV_VLLM := .venv-vllm
STAMP_VLLM := $(VENV_VLLM)/.installed
VLLM_SPEC ?= vllm==0.33.0
VLLM_TORCH_SPEC ?= torch==2.14.0
VLLM_TRITON_SPEC ?= triton==3.8.0
VLLM_IMPORT_DEPS := packaging==26.4 psutil==7.2.2 pyzmq==27.3.0 urllib3==2.8.0 \
  regex==2026.11.19 pydantic==2.14.4 cbor2==6.3.0 transformers==5.20.2 aiohttp==3.14.5 \
  requests==2.34.2 oss-harmony==0.0.11 openai==3.60.0 pillow==13.0.0 pybase64==1.5.1 \
  cachetools==8.0.2 msgspec==0.23.0 cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 \
  prometheus_client==0.26.0 xgrammar==0.2.8 fastapi==0.136.3 partial-json-parser==0.2.1.1.post7 \
  llguidance==1.7.6 einops==0.8.2

# SGLang 0.5.21 (it pins CI's torch 2.13.0) in its own environment too (make test-sglang): the
# suite's packages, then sglang and what the import chain of its DeepEP dispatcher needs,
# without their dependencies (sglang's own are CUDA builds).
VENV_SGLANG := .venv-sglang
STAMP_SGLANG := $(VENV_SGLANG)/.installed
SGLANG_SPEC ?= sglang==0.5.21
SGLANG_IMPORT_DEPS := transformers==5.12.1 huggingface_hub==1.33.0 tokenizers==0.22.2 \
  safetensors==0.8.0 regex==2026.11.19 PyYAML==6.0.4 httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 \
  anyio==4.16.0 sniffio==1.3.1 certifi==2026.10.19.post1 idna==3.20 requests==2.34.2 \
  urllib3==2.8.0 charset-normalizer==3.5.3 orjson==3.13.0 pybase64==1.5.1 pyzmq==27.3.0 \
  msgspec==0.23.0 starlette==1.10.0 ipython==9.18.1 traitlets==5.16.1 aiohttp==3.14.5 \
  aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1 \
  propcache==0.5.4 yarl==1.25.1 dill==0.4.1 sentencepiece==0.2.1 compressed-tensors==0.18.0 \
  loguru==0.7.3 gguf==0.19.0 openai==2.6.1 distro==1.9.0 partial-json-parser==0.2.1.1.post7 \
  uvicorn==0.55.0 click==8.5.1 fastapi==0.136.3 annotated-doc==0.0.7

.PHONY: gpu-wheels bench host-cost test test-quick test-vllm test-sglang mutants gpu-gate \
	gpu-gate-triton36 lint clean

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

# The suite keeps about one and a third of the two cores busy (its ranks wait on each other),
# so the two gates compile beside it at lower priority: first the DeepSeek-V3 variants under
# Triton 3.9 (the gate test, which pytest runs last, reads that run's result:
# MOE_COMM_GATE_BESIDE, the stem of its .rc, .log and .tsv), then a pairwise cover of them
# under Triton 3.6. make test fails if pytest or either gate fails; the gates' output follows
# pytest's.
# (the arguments of tests/test_gate.py's gate test: the same, or that test fails on the
# configurations and variants it finds)
GATE_ARGS := --arch 90 --brief-arch 100 --config dsv3-prefill dsv3-decode dsv3-prefill-rounds
test:  ## the whole suite (CI), the static gates under Triton 3.9 and 3.6 beside it
	$(MAKE) -j2 $(STAMP) $(STAMP36)  # the two environments side by side: a minute less
	@mkdir -p bench/results && rm -f bench/results/gpu_gate_beside.rc
	@( TRITON_INTERPRET=0 nice -n 10 $(BIN)/python -m moe_comm.testing.gate $(GATE_ARGS) \
	    --out bench/results/gpu_gate_beside.tsv > bench/results/gpu_gate_beside.log 2>&1; \
	  rc=$$?; echo $$rc > bench/results/gpu_gate_beside.rc.new; \
	  mv bench/results/gpu_gate_beside.rc.new bench/results/gpu_gate_beside.rc; \
	  cat bench/results/gpu_gate_beside.log; \
	  [ $$rc -eq 0 ] && nice -n 10 $(MAKE) gpu-gate-triton36 GATE36_COVER=pairs ) \
	  > bench/results/gates_beside.log 2>&1 & gates=$$!; \
	MOE_COMM_GATE_BESIDE=bench/results/gpu_gate_beside \
	  $(BIN)/python -m pytest -q --durations=25; tests=$$?; \
	wait $$gates; gated=$$?; cat bench/results/gates_beside.log; \
	echo "make test: pytest exit $$tests, gates exit $$gated"; \
	[ $$tests -eq 0 ] && [ $$gated -eq 0 ]

$(STAMP_VLLM): setup.py pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/pip install -q "$(VLLM_TORCH_SPEC)" "$(VLLM_TRITON_SPEC)" numpy "pytest==9.2.0"
	$(VENV_VLLM)/bin/pip install -q --no-deps "$(VLLM_SPEC)"
	$(VENV_VLLM)/bin/pip install -q $(VLLM_IMPORT_DEPS)
	$(VENV_VLLM)/bin/pip install -q --no-deps -e .
	touch $(STAMP_VLLM)

$(STAMP_SGLANG): setup.py pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_SGLANG)
	$(VENV_SGLANG)/bin/pip install -q "$(TORCH_SPEC)" "$(TRITON_SPEC)"
	$(VENV_SGLANG)/bin/pip install -q -e ".[test,megatron,deepspeed]"
	$(VENV_SGLANG)/bin/pip install -q --no-deps "$(SGLANG_SPEC)" $(SGLANG_IMPORT_DEPS)
	touch $(STAMP_SGLANG)

test-sglang: $(STAMP_SGLANG)  ## SGLang 0.5.21's DeepEP token dispatcher over moe_comm.deep_ep
	$(VENV_SGLANG)/bin/python -m pytest -q tests/test_sglang.py

test-vllm: $(STAMP_VLLM)  ## vLLM 0.33's DeepEP prepare/finalize over moe_comm.deep_ep (own venv)
	$(VENV_VLLM)/bin/python -m pytest -q tests/test_vllm.py

test-quick: $(STAMP)  ## the suite without the cases marked slow
	$(BIN)/python -m pytest -q -m "not slow"

mutants: $(STAMP)  ## one-line mutations of the product, each caught by its tests (not in test)
	$(BIN)/python tests/mutants.py

gpu-gate: $(STAMP)  ## every kernel as launched on a GPU, compiled for sm_90/sm_100 and read
	TRITON_INTERPRET=0 $(BIN)/python -m moe_comm.testing.gate --arch 90 100

# make test compiles a pairwise cover of the variants under Triton 3.6 (every pair of a
# kernel's specialisation values that meet at run time, about half the compiles), all of them
# under 3.9; `make gpu-gate-triton36` alone compiles every variant
GATE36_COVER ?= all
gpu-gate-triton36: $(STAMP36)  ## the same gate under Triton 3.6 (sm_90, DeepSeek-V3 sizes)
	TRITON_INTERPRET=0 $(VENV36)/bin/python -m moe_comm.testing.gate --arch 90 \
		--config dsv3-prefill dsv3-decode dsv3-prefill-rounds --cover $(GATE36_COVER) \
		--out bench/results/gpu_gate_triton36.tsv

lint: $(STAMP)
	$(BIN)/pip install -q ruff
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(VENV36) $(VENV_VLLM) $(VENV_SGLANG) .pytest_cache bench/results \
		*.egg-info
