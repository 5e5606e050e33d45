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

.PHONY: install test demo test-latest constraints clean bench-fidelity

$(BIN)/moectl: pyproject.toml $(CONSTRAINTS)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $(BIN)/moectl

install: $(BIN)/moectl

test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests

demo: install
	HF_HUB_OFFLINE=1 $(BIN)/moectl demo

# The fidelity yardstick (issue 31): build the reference model (~1 h on 2 cores, once; resumable: re-run to
# continue) and run the fidelity benchmarks on it. Never part of `make test`. Reports go to bench-fidelity/.
FIDELITY_OUT ?= bench-fidelity
bench-fidelity: install
	mkdir -p $(FIDELITY_OUT)
	HF_HUB_OFFLINE=1 nice -n 10 $(BIN)/moectl build-tiny --size reference
	HF_HUB_OFFLINE=1 $(BIN)/python bench/fidelity.py --model reference --max-tokens 4096 --json $(FIDELITY_OUT)/criteria.json
	HF_HUB_OFFLINE=1 $(BIN)/python bench/precision.py --model reference --json $(FIDELITY_OUT)/precision.json
	HF_HUB_OFFLINE=1 $(BIN)/python bench/gating.py --model reference --json $(FIDELITY_OUT)/gating.json

# The newest versions pyproject.toml allows, in a venv of their own: run before moving constraints.txt on.
test-latest:
	rm -rf $(LATEST)
	$(PY) -m venv $(LATEST)
	$(LATEST)/bin/pip install -q "$(TORCH_SPEC)"
	$(LATEST)/bin/pip install -q --upgrade -e ".[test]"
	$(LATEST)/bin/pip freeze --exclude-editable | grep -iE '^(transformers|accelerate|datasets|safetensors|tokenizers|typer|hqq|numpy|fastapi|uvicorn|openai)==' || true
	HF_HUB_OFFLINE=1 $(LATEST)/bin/python -m pytest -q tests

# Pin what .venv has now (after a green `make test` / `make test-latest`); torch stays the user's choice.
constraints:
	{ echo "# Exact versions the suite last passed with (make constraints). torch is pinned in the Makefile."; \
	  $(BIN)/pip freeze --exclude-editable | grep -viE '^(torch|triton|nvidia-)'; } > $(CONSTRAINTS)

clean:
	rm -rf $(VENV) $(LATEST)
