# Every install step lives here: `make test` and `make demo` work on a fresh clone.
# torch is pinned so that the CPU wheel already on the machine is used.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The adapters' tests run against the real trainers: TRL 1.16 and verl 0.9.1 in one environment.
# torch==2.13.0 beside them keeps pip from pulling another torch; verl goes in --no-deps, with
# what its loss path imports (ray, tensordict, omegaconf, hydra-core, codetiming).
INTEGRATIONS := $(VENV)/.integrations
INTEGRATION_PINS := "transformers>=5.5.3,<5.11,!=5.6.0"
VERL_LOSS_DEPS := ray "tensordict>=0.8,<=0.10.0,!=0.9.0" omegaconf hydra-core codetiming

.PHONY: setup test peers demo list clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

$(INTEGRATIONS): $(STAMP)
	$(PY) -m pip install --quiet torch==2.13.0 -e ".[dev,trl]" $(INTEGRATION_PINS) $(VERL_LOSS_DEPS)
	$(PY) -m pip install --quiet --no-deps "verl>=0.9.1,<0.10"
	touch $(INTEGRATIONS)

# The parity tests read some trainers' loss code from their released source, without installing it
# (their package imports pull in whole training stacks): Trinity-RFT's and tinker-cookbook's wheels,
# unpacked here. The sources not on the package index (SkyRL, prime-rl, verl-recipe, NeMo-RL) are read
# when their PGLOSS_*_SRC is set, else those tests are skipped.
SOURCES := $(VENV)/sources
TRAINER_SOURCES := $(SOURCES)/.unpacked
$(TRAINER_SOURCES): $(STAMP)
	$(PY) -m pip download --quiet --no-deps trinity-rft==0.6.0 tinker-cookbook==0.6.1 -d $(SOURCES)
	$(PY) -m zipfile -e $(SOURCES)/trinity_rft-0.6.0-py3-none-any.whl $(SOURCES)/trinity
	$(PY) -m zipfile -e $(SOURCES)/tinker_cookbook-0.6.1-py3-none-any.whl $(SOURCES)/tinker
	touch $(TRAINER_SOURCES)

test: $(STAMP) $(INTEGRATIONS) $(TRAINER_SOURCES)
	PGLOSS_TRINITY_SRC=$${PGLOSS_TRINITY_SRC:-$(SOURCES)/trinity} PGLOSS_TINKER_SRC=$${PGLOSS_TINKER_SRC:-$(SOURCES)/tinker} \
	$(PY) -m pytest -n 2 tests

# The trainers' own loss tests (tests/peers/): swapped to pgloss (as in `make test`), then unmodified.
peers: $(STAMP) $(INTEGRATIONS)
	$(PY) -m pytest -q -rx tests/peers/verl
	PGLOSS_PEERS=original $(PY) -m pytest -q tests/peers/verl

demo: $(STAMP)
	$(VENV)/bin/pgloss losses
	$(VENV)/bin/pgloss compare

list: $(STAMP)
	$(VENV)/bin/pgloss list

clean:
	rm -rf $(VENV) build src/*.egg-info
