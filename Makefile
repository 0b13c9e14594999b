# Two commands on a fresh machine (see README): `make run` and `make test`.
# Both create the virtual environment first if needed (CPU-only torch; no CUDA wheels).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.qerl-installed

.PHONY: run test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

## run the main job on the embedded default (config/config.yaml)
run: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/snakemake --cores all

## run the whole test suite
test: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest

clean:
	rm -rf results logs .snakemake
