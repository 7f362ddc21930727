# Two commands matter: `make serve` runs Berth, `make test` runs the suite.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test install protos lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/berth serve

test: $(STAMP)
	$(BIN)/pytest -q $(PYTEST_ARGS)

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py
	$(BIN)/buf lint

lint: $(STAMP)
	$(BIN)/buf lint
	$(BIN)/buf breaking --against ".git#ref=HEAD~1"
	$(BIN)/lint-imports
	$(BIN)/mypy services gateway

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .berth .pytest_cache
