# Two entry points on a fresh machine: `make serve` and `make test`.
# Both create .venv with Python 3.12 when it is missing and install kk_jax into it.
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

# First Python 3.12 found: python3.12 on PATH, else a pyenv-provided 3.12.
PYTHON312 := $(shell for c in "python3.12" "env PYENV_VERSION=3.12.1 python3"; do \
	$$c -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo $$c; break; }; done)

.PHONY: serve test install

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "Python 3.12 is required (python3.12 not found)"; exit 1; }
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

install: $(VENV)/.installed

serve: $(VENV)/.installed
	$(PY) serve.py $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 tests
