# Two commands on a fresh machine (see README): `make run` and `make test`.
# Both create the virtual environment first if needed (CPU-only torch; no CUDA wheels).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.qerl-installed

.PHONY: run test install example-report clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip
	$(BIN)/pip install --quiet -e ".[test,slurm]"
	# test-only judge of the four-over-six scale rule: the authors' package, its pure-PyTorch reference (an sdist
	# whose CUDA kernels are skipped; it builds against the torch installed above)
	$(BIN)/pip install --quiet "setuptools>=75" packaging
	SKIP_CUDA_BUILD=1 $(BIN)/pip install --quiet --no-build-isolation --no-deps fouroversix==1.0.5
	touch $(STAMP)

install: $(STAMP)

## run the whole workflow on the embedded default (config/config.yaml); outputs under results/
## (a rerun does only what is missing or out of date; CONFIGFILES="config/paper.yaml" for another config,
## SNAKEMAKE_ARGS for more snakemake options)
CONFIGFILES ?=
run: $(STAMP)
	@for f in $(CONFIGFILES); do [ -f "$$f" ] || { echo "make run: CONFIGFILES: $$f: no such config file" >&2; exit 2; }; done
	QERL_MAKE=1 $(BIN)/snakemake --cores all $(if $(CONFIGFILES),--configfile $(CONFIGFILES)) $(SNAKEMAKE_ARGS)
	@$(BIN)/python -m qerl.workflow_config where $(CONFIGFILES)

## copy the default workflow's report (results/reports/default) into the committed example, reports/default
example-report: run
	$(BIN)/qerl report --workflow-config results/config/default.yaml --results results --output reports/default

## run the whole test suite, then its numerics-sensitive tests (-m numerics) again on other CPU kernels: ATen's
## default (non-vectorized) kernels, MKL and oneDNN held to AVX2 -- no result may depend on this machine's CPU.
## TEST_WORKERS pytest-xdist processes of one thread each (2: the 2-core CI machine; the tests sharing the default
## workflow's run are one xdist_group, so that run is made once); TEST_WORKERS=0 runs in this process.
NUMERICS_ENV ?= ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=default
TEST_WORKERS ?= 2
PYTEST := $(if $(filter 0,$(TEST_WORKERS)),$(BIN)/python -m pytest,OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup)
test: $(STAMP)
	$(PYTEST)
	$(NUMERICS_ENV) $(PYTEST) -m numerics

clean:
	rm -rf results logs .snakemake
