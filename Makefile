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

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15 optax_offload tests $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks $(ARGS)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

lint: $(STAMP)
	$(VENV)/bin/ruff check optax_offload tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
