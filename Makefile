# The two commands of the README. Both create .venv on first use and install everything the
# tests import (the `dev` extra pulls in DALI and CuPy too, which run/import on CPU).
# Once .venv exists, on the project's 2-core machine with other jobs on it: `make demo` 35 s-1.5 min (the load
# sets it; README.md has the recorded runs), `make test` 4.5-5 min (267-291 s of pytest, 2026-12-06).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check minidp tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
