# The two entry points: `make serve` and `make test`. Both set up .venv from scratch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: serve test test-fast install model bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 first: it is a local CPU wheel here, while an unpinned torch would pull
# a multi-GB CUDA build.
$(STAMP): $(VENV)/bin/python pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(PY) -m kvloom fetch-model

serve: model
	$(PY) -m kvloom serve

test: $(STAMP)
	$(PY) -m pytest -q

# The inner loop (about 75 s on 2 cores): everything but the tests on the default model.
test-fast: $(STAMP)
	$(PY) -m pytest -q -x -k "not default and not smollm2"

clean:
	rm -rf $(VENV) build *.egg-info
