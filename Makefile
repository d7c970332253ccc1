# The two commands of the README. Both set up .venv first (scripts/setup.sh, idempotent).
PY := .venv/bin/python

.PHONY: setup demo test test-fast lint

setup:
	@scripts/setup.sh

demo: setup
	$(PY) recipes/pretrain.py

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(PY) -m ruff check .
