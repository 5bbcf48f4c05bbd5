# Thin wrappers: the logic lives in the gemmaserve package.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
GEMMASERVE := $(VENV)/bin/gemmaserve

.PHONY: venv test test-unit lint demo demo-down bench

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[infra,hosts,test]'
	touch $@

# Everything: unit, Pulumi mocks, policy, workflow lint, and the sandbox (real hosts, real vLLM).
test: venv
	$(PY) -m pytest

test-unit: venv
	$(PY) -m pytest tests/unit

demo: venv
	$(GEMMASERVE) demo

demo-down: venv
	$(GEMMASERVE) demo --down
