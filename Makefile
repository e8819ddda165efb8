# Every target builds its own virtual environment from the package registry when it is
# missing or older than pyproject.toml, so a fresh machine with only Python 3.11 needs nothing else.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-engine test-clients bench lint clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or make PYTHON=python3)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m loadtest.demo

test: $(STAMP)
	$(PY) -m pytest -q

# Installs vLLM for CPU into ~/.cache/kvlb (once per machine) and runs kvlb against it.
test-engine: $(STAMP)
	$(PY) -m pytest -q -s -m engine tests/engine

# Standard benchmark clients in environments of their own (aiperf pins its own packages).
AIPERF_VENV := .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.installed

$(AIPERF_STAMP):
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(AIPERF_VENV)/bin/python -m pip install --quiet 'aiperf==0.13.*'
	touch $(AIPERF_STAMP)

test-clients: $(STAMP) $(AIPERF_STAMP)
	$(PY) -m pytest -q -s -m clients tests/clients

bench: $(STAMP)
	$(PY) -m loadtest.bench.proxy
	$(PY) -m loadtest.bench.stream
	$(PY) -m loadtest.bench.flow

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
