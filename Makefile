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

# The whole suite (what CI runs, via .ci/run), then its 15 slowest tests. Two pytest-xdist workers,
# each taking a test file whole (--dist loadfile): a file's module fixtures, the batched launches
# of tests/e2e among them, are built once. (--dist loadgroup cannot group under pytest 9: xdist
# 3.8 renames a grouped test's node id, which pytest 9 derives anew, so every test became its
# own unit and the batched fixtures were built on both workers.)
test: lint
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=15

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
