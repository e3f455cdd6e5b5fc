# Every install step lives here: `make test` and `make demo` work on a fresh clone.
# torch is pinned so that the CPU wheel already on the machine is used.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test demo list clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n 2 tests

demo: $(STAMP)
	$(VENV)/bin/pgloss losses
	$(VENV)/bin/pgloss compare

list: $(STAMP)
	$(VENV)/bin/pgloss list

clean:
	rm -rf $(VENV) build src/*.egg-info
