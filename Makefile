# Thin wrappers: the logic lives in the gemmaserve package.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
GEMMASERVE := $(VENV)/bin/gemmaserve
# make demo ENGINE=container: the same demo from a locally built image under podman.
ENGINE ?= wheel

.PHONY: venv system-packages test check lint demo demo-down

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[infra,hosts,plot,test]'
	touch $@

# The system tools the tests drive for real (sandbox, promtool), installed where missing.
system-packages:
	bash .ci/system-packages

# Everything: lint, unit, Pulumi mocks, policy, workflow lint, and the sandbox (real hosts, real vLLM). Two
# workers: the sandbox tier in order on one, the rest in order on the other (tests/conftest.py, docs/testing.md).
test: venv system-packages lint
	$(PY) -m pytest -n 2

# The fast tier (docs/testing.md, "Test tiers"): lint and every test needing no sandbox host, no vLLM CPU venv
# and no network, a test module at a time on each of two workers (most of its time is waiting on programs).
check: venv lint
	$(PY) -m pytest -n 2 --dist loadfile -m "not sandbox and not vllm and not network"

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

demo: venv
	$(GEMMASERVE) demo --engine $(ENGINE)

demo-down: venv
	$(GEMMASERVE) demo --down
