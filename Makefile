# Two commands do all set-up on a fresh machine:
#   make repro   create the virtual environment if missing, install, run the whole DVC pipeline
#   make metrics the committed headline numbers (dvc metrics show, dvc exp show on a few columns)
#   make test    the same install, then the whole test suite on every core (CI runs it)
#   make test-quick  the unit tier only (no integration or e2e test), for the edit loop
#   make check   the same install, then ruff and mypy (CI runs it before `make test`)
#   make demo    emulated 1P3D SGLang + the real router + the gateway, agents replayed through a surge
#   make docs    the documentation site (mkdocs build --strict into site/; `.venv/bin/mkdocs serve` to browse)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: repro metrics test test-quick demo install check lint typecheck docs bench mlflow-ui clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Re-install whenever the dependency list changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[all]"
	touch $(STAMP)

install: $(STAMP)

# params.yaml checked whole first (a bad value stops here, before DVC deletes any stage's outputs);
# the headline last: DVC's own last lines (a `git add dvc.lock` hint) are not what a run measured.
repro: $(STAMP)
	$(BIN)/python -m basin_pipeline.params params.yaml
	PATH="$(CURDIR)/$(BIN):$$PATH" DVC_NO_ANALYTICS=1 dvc repro
	@$(BIN)/python -m basin_pipeline.headline

# The committed numbers at a glance: the headline metric files (a row each, a column per benchmark), the
# experiments beside the workspace with only those columns (no params, no dependency hashes), the headline.
EXP_COLUMNS := '^(Experiment|Created)$$|^metrics/(spearman_unseen|cover90|goodput)\.json:'
metrics: $(STAMP)
	@DVC_NO_ANALYTICS=1 $(BIN)/dvc metrics show
	@echo
	@DVC_NO_ANALYTICS=1 $(BIN)/dvc exp show --no-pager --md --precision 3 --drop '.*' --keep $(EXP_COLUMNS)
	@echo
	@$(BIN)/python -m basin_pipeline.headline

# -n auto: one worker per core (tests/conftest.py gives each its own ports); whole files per worker, in the
# order tests/conftest.py sorts them (integration and e2e first; xdist would reorder by test count);
# --durations: the 25 slowest, so growth shows in every CI log. PYTEST_ARGS adds options (-k gateway, ...).
PYTEST_ARGS ?=
PYTEST := $(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	$(PYTEST) --durations=25 $(PYTEST_ARGS)

test-quick: $(STAMP)
	$(PYTEST) -m "not integration and not e2e" $(PYTEST_ARGS)

# The session table first (real corpora when present, else the synthetic corpus; ~15 s), then the demo.
DEMO_ARGS ?=
demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" DVC_NO_ANALYTICS=1 dvc repro ingest
	$(BIN)/python -m basin_stack.demo $(DEMO_ARGS)

# `make check` is what CI runs before the tests (.ci/run): ruff, then mypy --strict on the files
# [tool.mypy] lists in pyproject.toml. `make -k check` reports both even when the first fails.
LINT_PATHS := basin_runtime basin_sim pipeline rig tests benchmarks deploy
check: lint typecheck docs

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)

typecheck: $(STAMP)
	$(BIN)/mypy

# The site: every page under docs/, strict (a broken link or a page missing from the nav fails it).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

mlflow-ui: $(STAMP)
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db

clean-venv:
	rm -rf $(VENV)
