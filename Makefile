# README's two set-up-and-go commands: `make train` (the main job) and `make test`; `make docs`
# builds the documentation.
# Each creates .venv with Python 3.11 if needed, installs the requirements, builds the
# custom ops against the installed TensorFlow, and runs.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hetpipe-installed
SOURCES := requirements.txt requirements-no-deps.txt setup.py pyproject.toml $(wildcard hetpipe_tf/ops/cc/*/*.cc)

$(STAMP): $(SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-no-deps.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-build-isolation -e .
	touch $@

.PHONY: install train test test-all
install: $(STAMP)

train: $(STAMP)
	$(BIN)/hetpipe-train $(ARGS)

# CI's subset: every test but the multi-process ones marked slow (see README), after the import
# contracts, the type checker and the docstring linter (ruff.toml).
test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy
	$(BIN)/ruff check --no-cache
	$(BIN)/python -m pytest -q -m "not slow" tests $(ARGS)

test-all: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q tests $(ARGS)

# The package as a user installs it (tests/wheel_check.py, run by CI): an sdist and a wheel from
# `python -m build`, the wheel installed into a fresh venv, the main job run from outside the
# checkout. ARGS="--install=source" installs `pip install .[cpu]` instead; ARGS="--remedy" also
# checks the remedy that a mismatched TensorFlow gets.
.PHONY: wheel-check
wheel-check: $(STAMP)
	$(BIN)/python tests/wheel_check.py $(ARGS)

# The Horovod baseline's own venv, build/horovod-venv (benchmarks/horovod/README.md).
.PHONY: horovod
horovod:
	bash benchmarks/horovod/setup.sh

# The documentation (docs/, mkdocs.yml) with its API reference from the docstrings, in a venv of
# its own: griffe reads the sources statically, so neither TensorFlow nor hetpipe_tf is installed
# there. --strict: a broken reference, link or anchor fails the build. The site goes to site/.
DOCS_VENV ?= .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.hetpipe-docs-installed

$(DOCS_STAMP): docs/requirements.txt
	test -x $(DOCS_VENV)/bin/python || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q --disable-pip-version-check -r docs/requirements.txt
	touch $@

# docs/cli.md, the command line's reference, is generated from the flags' definitions first
# (docs/cli_reference.py, with the project's venv: absl and hetpipe_tf's flag modules).
.PHONY: docs
docs: $(DOCS_STAMP) $(STAMP)
	$(BIN)/python docs/cli_reference.py docs/cli.md
	$(DOCS_VENV)/bin/mkdocs build --strict
