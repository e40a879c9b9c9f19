# Two commands do all set-up on a fresh machine:
#   make repro   create the virtual environment if missing, install, run the whole DVC pipeline
#   make test    the same install, then the test suite
#   make demo    emulated 1P3D SGLang + the real router + the gateway, agents replayed through a surge
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: repro test demo install lint typecheck bench mlflow-ui clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Re-install whenever the dependency list changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[all]"
	touch $(STAMP)

install: $(STAMP)

repro: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" DVC_NO_ANALYTICS=1 dvc repro

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The session table first (real corpora when present, else the synthetic corpus; ~15 s), then the demo.
DEMO_ARGS ?=
demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" DVC_NO_ANALYTICS=1 dvc repro ingest
	$(BIN)/python -m basin_stack.demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check basin_runtime basin_sim pipeline tests benchmarks
	$(BIN)/mypy

mlflow-ui: $(STAMP)
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db

clean-venv:
	rm -rf $(VENV)
