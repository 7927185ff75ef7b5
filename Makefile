# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-serving test test-all lint bench proto docs clean

$(STAMP): pyproject.toml constraints.txt scripts/install-system-deps.sh cffi_build/uring_io.c cffi_build/uring_build.py
	bash scripts/install-system-deps.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,bench,torch]'
	$(PY) -m cffi_build.uring_build
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m kvstore.demo

demo-serving: $(STAMP)
	$(VENV)/bin/kvstore demo serving

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(VENV)/bin/kvstore bench api

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. kvstore/proto/kvstore.proto

docs: $(STAMP)
	$(PY) scripts/gen_reference.py

clean:
	rm -rf $(VENV) build *.egg-info
