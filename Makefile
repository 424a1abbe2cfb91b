# `make test` and `make demo` set everything up themselves on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 6006
PYTEST_ARGS ?=

.PHONY: test demo benchmark clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[$*]' --config-settings editable_mode=compat
	touch $@

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

demo: $(VENV)/.installed-examples
	$(BIN)/python examples/quickstart.py --logdir runs/demo
	$(BIN)/tensorboard --logdir runs --host 127.0.0.1 --port $(PORT)

benchmark: $(VENV)/.installed-examples
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
