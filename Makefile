# Two commands for a new user: `make demo` and `make test`. Both build .venv first,
# and rebuild it whenever requirements.txt changes (the stamp holds its checksum).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements.sha256
REQ_SUM := $(shell sha256sum requirements.txt setup.py | sha256sum | cut -c1-16)

export PJRT_DEVICE ?= CPU

.PHONY: venv demo test bench clean

venv:
	@if [ ! -x $(PY) ] || [ "$$(cat $(STAMP) 2>/dev/null)" != "$(REQ_SUM)" ]; then \
		echo "Setting up $(VENV) (requirements changed or missing)"; \
		rm -rf $(VENV) && \
		$(PYTHON) -m venv $(VENV) && \
		$(PY) -m pip install -q --upgrade pip && \
		$(PY) -m pip install -q -r requirements.txt && \
		$(PY) -m pip install -q --no-deps -e . && \
		echo "$(REQ_SUM)" > $(STAMP); \
	fi

demo: venv
	$(PY) -m tpu_utility.demo

test: venv
	$(PY) -m pytest -q tests

bench: venv
	$(PY) -m pip install -q -r bench/requirements.txt
	$(PY) bench/run.py
	$(PY) bench/cache_bench.py

clean:
	rm -rf $(VENV) demo_out bench/out
