# Two commands a fresh clone needs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned here (not in pyproject): 2.13.0 is the CPU build on disk; any other spec pulls CUDA wheels.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test demo clean

$(BIN)/moectl: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $(BIN)/moectl

install: $(BIN)/moectl

test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests

demo: install
	HF_HUB_OFFLINE=1 $(BIN)/moectl demo

clean:
	rm -rf $(VENV)
