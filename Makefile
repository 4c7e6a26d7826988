# Two commands on a fresh machine (Python 3.11 + pip + the package registry):
#   make demo    venv, install, run the embedded digits demo
#   make test    venv, install, all tests
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS := requirements/constraints.txt
STAMP := $(VENV)/.trakflow-installed
TEST_WORKERS ?= 2

.PHONY: all install demo test lint format serve server clean-demo

all: test

install: $(STAMP)

# torch first and alone (the CPU wheel); anything resolving torch later must find it satisfied, or
# pip would pull GB of CUDA wheels. traker 0.3.2 (the reference implementation, a test oracle) without
# its dependencies for the same reason. --no-cache-dir: no second copy of every downloaded wheel in pip's cache
# (a CI machine once ran out of disk during this install).
$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-cache-dir torch==2.13.0
	$(BIN)/python -m pip install -q --no-cache-dir -c $(CONSTRAINTS) -e '.[test,lint]'
	$(BIN)/python -m pip install -q --no-cache-dir --no-deps traker==0.3.2
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/trakflow demo

# two pytest-xdist workers, a test module per worker at a time (module fixtures such as a real Prefect server are
# shared by its tests): most tests wait on process starts and services, so two workers fit two cores. Modules go
# out in collection order (tests/conftest.py puts the long real-service modules first), not by their test count
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# ruff (lint + format check) on the whole tree, mypy on trak_core; settings in pyproject.toml
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# apply ruff's fixes and formatting
format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# local Prefect server (SQLite) with the UI on http://127.0.0.1:4200
server: $(STAMP)
	$(BIN)/prefect server start

# register the deployments with the server above and serve them
serve: $(STAMP)
	PREFECT_API_URL=$${PREFECT_API_URL:-http://127.0.0.1:4200/api} $(BIN)/python -m deployments.serve

clean-demo:
	rm -rf trakflow_demo
