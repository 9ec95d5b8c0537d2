# qlab: two commands on a fresh clone.
#   make run    set up .venv, provision the model, run the whole experiment suite into results/
#   make test   set up .venv, provision the model, run the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Extras installed by `make setup`: dev tools, and the llama.cpp peer (llama-cpp-python, built
# from source in about 5 minutes; PEERS=0 skips it and the tests that need it skip).
PEERS ?= 1
comma := ,
EXTRAS := dev$(if $(filter 1,$(PEERS)),$(comma)peers,)
# llama.cpp's native build uses AMX tiles, which crash in this VM (see DESIGN.md).
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

.PHONY: run test setup models lint clean-results

run: setup models
	$(PY) -m qlib suite run

test: setup models
	$(PY) -m pytest -q

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

models: setup
	$(PY) -m qlib models fetch

lint: setup
	$(VENV)/bin/ruff check qlib tests

clean-results:
	rm -rf results/*
