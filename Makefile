# make demo  - set up .venv and train a small model with offloaded optimizer state (CPU by default)
# make test  - set up .venv and run the test suite
# make docs  - build the documentation site into site/
# make bench - run the benchmarks and write bench_out/REPORT.md
PYTHON ?= python3
# CPU by default (the test extra installs the CUDA plugin for compile-only GPU programs; without
# this JAX would look for a GPU first). `make demo JAX_PLATFORMS=cuda` on a GPU machine.
export JAX_PLATFORMS ?= cpu
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench docs lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,examples]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py $(ARGS)

# Two pytest-xdist workers (the CI machine's cores): the suite is mostly single-threaded compiles.
# Each worker holds a JAX runtime (~1-3 GB); `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15 -n $(TEST_WORKERS) --dist loadgroup optax_offload tests $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks $(ARGS)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

lint: $(STAMP)
	$(VENV)/bin/ruff check optax_offload tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
