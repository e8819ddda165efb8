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

# inference-perf installs only under Python 3.12: pyenv's, or the system's, where there is one.
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12))
IPERF_VENV := .venv-inference-perf
IPERF_STAMP := $(IPERF_VENV)/.installed

$(IPERF_STAMP):
	@if [ -z "$(PYTHON312)" ]; then echo "no Python 3.12 here: the inference-perf tests are skipped"; exit 0; fi; \
	set -e; test -x $(IPERF_VENV)/bin/python || $(PYTHON312) -m venv $(IPERF_VENV); \
	$(IPERF_VENV)/bin/python -m pip install --quiet --upgrade pip; \
	$(IPERF_VENV)/bin/python -m pip install --quiet 'inference-perf==0.7.*'; \
	touch $(IPERF_STAMP)

test-clients: $(STAMP) $(AIPERF_STAMP) $(IPERF_STAMP)
	$(PY) -m pytest -q -s -m clients tests/clients

bench: $(STAMP)
	$(PY) -m loadtest.bench.proxy
	$(PY) -m loadtest.bench.stream
	$(PY) -m loadtest.bench.flow
	$(PY) -m loadtest.bench.tracing

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
