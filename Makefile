# make demo  - set up .venv and train a small model with offloaded optimizer state (CPU by default)
# make test  - set up .venv and run the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint clean

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

lint: $(STAMP)
	$(VENV)/bin/ruff check optax_offload tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
