# Two commands matter: `make serve` runs Berth, `make test` runs the suite.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The official Node SDK the Node conformance test drives (tests/e2e/node).
NODE_SDK := tests/e2e/node/node_modules/.package-lock.json

.PHONY: serve test install protos lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

$(NODE_SDK): tests/e2e/node/package-lock.json
	cd tests/e2e/node && npm ci --no-audit --no-fund --loglevel=error

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/berth serve

test: $(STAMP) $(NODE_SDK)
	$(BIN)/pytest -q $(PYTEST_ARGS)

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py
	$(BIN)/buf lint

# Each test package has a conftest.py of its own, so mypy checks the suite's
# root modules and each package in a run of its own (tests/mypy.ini).
TEST_PACKAGES := core e2e environment gateway sandbox session

lint: $(STAMP)
	$(BIN)/buf lint
	$(BIN)/buf breaking --against ".git#ref=HEAD~1"
	$(BIN)/lint-imports
	$(BIN)/mypy services gateway
	MYPYPATH=tests $(BIN)/mypy --config-file tests/mypy.ini tests/*.py
	for package in $(TEST_PACKAGES); do \
	  MYPYPATH=tests:tests/$$package:tests/sandbox $(BIN)/mypy --config-file tests/mypy.ini \
	    $$(find tests/$$package -name '*.py' -not -path '*/mcp_servers/*') || exit 1; \
	done

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .berth .pytest_cache tests/e2e/node/node_modules
