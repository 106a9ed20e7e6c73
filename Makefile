# `make test` and `make demo` are the whole set-up: each creates .venv if it is missing and
# installs the project (editable, dev + hf extras) with the CPU build of torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-fast lint demo bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned, so pip takes the local CPU wheel and never a CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev,hf,highs]"
	touch $(STAMP)

# The whole suite (what CI runs, via .ci/run), then its 15 slowest tests. Two pytest-xdist workers:
# every test that starts processes runs on one of them in turn, the in-process tests beside it a
# file at a time (tests/conftest.py, pytest_collection_modifyitems).
test: lint
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --durations=15

# The inner loop: every test that starts no process and no process group (not marked `dist`); no lint.
test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not dist" --durations=15

# The architecture's import rules (pyproject.toml [tool.importlinter]), pyflakes and import order,
# the formatter's check and the type checker (pyproject.toml [tool.mypy]); part of `make test`.
lint: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check --quiet .
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/mypy

demo: $(STAMP)
	$(PY) -m planner.demo

bench: $(STAMP)
	$(PY) -m pytest -q -m slow benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
