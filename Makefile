# Two commands a fresh clone needs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
LATEST := .venv-latest
# torch is pinned here (not in pyproject): 2.13.0 is the CPU build on disk; any other spec pulls CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
# Every other dependency at the exact version the suite last passed with (pyproject.toml keeps ranges for
# people who pip-install moectl into their own environment). `make constraints` rewrites it from .venv.
CONSTRAINTS := constraints.txt

.PHONY: install test demo test-latest constraints clean gpu-check gpu-bundle install-llamacpp test-llamacpp bench-llamacpp bench-gguf \
	bench-gguf-avx2 bench-fidelity

$(BIN)/moectl: pyproject.toml $(CONSTRAINTS)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $(BIN)/moectl

install: $(BIN)/moectl

test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests

# llama.cpp beside moectl (not part of `make test`: the first build takes minutes; later runs reuse
# $MOECTL_HOME/llamacpp/<version>/). Needs cmake and a C++ compiler.
install-llamacpp: install
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[test,llamacpp]"

test-llamacpp: install-llamacpp
	MOECTL_TEST_LLAMACPP=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -s tests/test_llamacpp.py tests/test_gguf_llamacpp.py

bench-llamacpp: install-llamacpp
	HF_HUB_OFFLINE=1 PYTHONPATH=. $(BIN)/python bench/vs_llamacpp.py --shape mixtral --layers 2 --repeat 3
	HF_HUB_OFFLINE=1 PYTHONPATH=. $(BIN)/python bench/vs_llamacpp.py --shape qwen3-moe --layers 2 --repeat 3
	HF_HUB_OFFLINE=1 PYTHONPATH=. $(BIN)/python bench/vs_llamacpp.py --fidelity

# Issue 42's table (bench/gguf_vs_llamacpp.py): moectl and llama.cpp on the same GGUF files (llama.cpp's converter and
# llama-quantize on make-synthetic checkpoints, 2 layers), Qwen3 shape (128 experts, top-8) and Mixtral shape (8, top-2)
# in the whole file set, the GPT-OSS shape in MXFP4; 1 and 2 threads. The files are made on the first run (~25 GB; the
# Mixtral and GPT-OSS BF16 files are deleted once quantized: not timed). Run it on a quiet machine. JSON in $(GGUF_OUT)/.
GGUF_OUT ?= bench-gguf
GGUF_BENCH = HF_HUB_OFFLINE=1 PYTHONPATH=. $(BIN)/python bench/gguf_vs_llamacpp.py --layers 2 --threads 1 2 --repeat 3
bench-gguf: install-llamacpp
	mkdir -p $(GGUF_OUT)
	$(GGUF_BENCH) --shape qwen3-moe --json $(GGUF_OUT)/qwen3-moe.json
	$(GGUF_BENCH) --shape mixtral --drop-bf16 --json $(GGUF_OUT)/mixtral.json
	$(GGUF_BENCH) --shape gpt-oss-20b --drop-bf16 --json $(GGUF_OUT)/gpt-oss-20b.json

# Issue 42's AVX2 table: the same files (made by bench-gguf, or here), both tools restricted to AVX2 on an AVX-512 host:
# llama.cpp's tools built GGML_NATIVE=OFF GGML_AVX2=ON into bin-avx2/, moectl's ggml likewise into ggml-avx2/
# (MOECTL_GGML_ISA=avx2, its AVX-512 kernels off); refused where either side reports AVX-512 (docs/gguf.md).
bench-gguf-avx2: install-llamacpp
	mkdir -p $(GGUF_OUT)
	$(GGUF_BENCH) --isa avx2 --shape qwen3-moe --types Q4_K_M Q8_0 --json $(GGUF_OUT)/qwen3-moe-avx2.json
	$(GGUF_BENCH) --isa avx2 --shape mixtral --drop-bf16 --types Q4_K_M Q8_0 --json $(GGUF_OUT)/mixtral-avx2.json

demo: install
	HF_HUB_OFFLINE=1 $(BIN)/moectl demo

# Issue 44's check in one device call (bench/gpu_check.py; report in $$OUT or ./gpu-check): moectl against llama.cpp's
# --n-cpu-moe on the same GGUF and VRAM. With a GPU it runs on the interpreter that has the CUDA torch, from the
# bundle `make gpu-bundle` made (never .venv); without one it says so and does the dry run from .venv (make test runs
# it). GPU_CHECK_ARGS: e.g. --minutes 9 --skip copy,attention (docs/gpu-check.md has the lent machines' recipe).
gpu-check:
	@if command -v nvidia-smi >/dev/null 2>&1; then HF_HUB_OFFLINE=1 $(PY) bench/gpu_check.py $(GPU_CHECK_ARGS); \
	else $(MAKE) -s install && HF_HUB_OFFLINE=1 $(BIN)/python bench/gpu_check.py $(GPU_CHECK_ARGS); fi

# What a lent GPU machine cannot make itself (bench/gpu_bundle.py): llama.cpp's CUDA tools built here for sm_90
# (hours on this 2-core machine: docs/gpu-check.md; its objects are reused), its converter, the wheels the image lacks;
# one gpu-bundle.tar.xz (git-ignored), checked complete and within the device tool's 64 MiB carry with the checkout,
# its size printed. Reused when nothing changed. Needs nvcc, cmake, a C++ compiler and the package index. Not part
# of `make test`; docs/gpu-check.md has the `run` call that carries it.
gpu-bundle: install
	HF_HUB_OFFLINE=1 nice -n 10 $(BIN)/python bench/gpu_bundle.py --out gpu-bundle.tar.xz

# The fidelity yardstick (issue 31): build the reference model (~45 min on 2 cores, once; resumable: re-run to
# continue) and run the fidelity benchmarks on it. Never part of `make test`. Reports go to bench-fidelity/.
FIDELITY_OUT ?= bench-fidelity
bench-fidelity: install
	mkdir -p $(FIDELITY_OUT)
	HF_HUB_OFFLINE=1 nice -n 10 $(BIN)/moectl build-tiny --size reference
	HF_HUB_OFFLINE=1 $(BIN)/python bench/fidelity.py --model reference --max-tokens 32768 --llamacpp-chunks 0 --json $(FIDELITY_OUT)/criteria.json
	HF_HUB_OFFLINE=1 $(BIN)/python bench/precision.py --model reference --max-tokens 4096 --decode-tokens 2048 --json $(FIDELITY_OUT)/precision.json
	HF_HUB_OFFLINE=1 $(BIN)/python bench/gating.py --model reference --json $(FIDELITY_OUT)/gating.json

# The newest versions pyproject.toml allows, in a venv of their own: run before moving constraints.txt on.
test-latest:
	rm -rf $(LATEST)
	$(PY) -m venv $(LATEST)
	$(LATEST)/bin/pip install -q "$(TORCH_SPEC)"
	$(LATEST)/bin/pip install -q --upgrade -e ".[test]"
	$(LATEST)/bin/pip freeze --exclude-editable | grep -iE '^(transformers|accelerate|datasets|safetensors|tokenizers|typer|hqq|numpy|fastapi|uvicorn|openai)==' || true
	HF_HUB_OFFLINE=1 $(LATEST)/bin/python -m pytest -q tests

# Pin what .venv has now (after a green `make test` / `make test-latest`); torch stays the user's choice. triton
# stays pinned: the test extra installs it (the interpreter twins of the GPU kernels) beside the CPU torch.
constraints:
	{ echo "# Exact versions the suite last passed with (make constraints). torch is pinned in the Makefile."; \
	  $(BIN)/pip freeze --exclude-editable | grep -viE '^(torch|nvidia-)'; } > $(CONSTRAINTS)

clean:
	rm -rf $(VENV) $(LATEST)
