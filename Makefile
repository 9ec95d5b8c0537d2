# qlab: two commands on a fresh clone.
#   make run    set up .venv, provision the model, run the whole experiment suite into results/
#   make test   set up .venv, provision the model, run the test suite
#   make lab    open the notebooks in JupyterLab (LAB_ARGS="--no-browser --port 8899")
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Extras installed by `make setup`: the suite (lab), the references (refs), dev tools, and the
# llama.cpp peer (llama-cpp-python, built from source in about 5 minutes; PEERS=0 skips it and
# the tests that need it skip).
PEERS ?= 1
comma := ,
EXTRAS := dev$(comma)lab$(comma)refs$(if $(filter 1,$(PEERS)),$(comma)peers,)
# llama.cpp's native build uses AMX tiles, which crash in this VM (see docs/design.md).
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

.PHONY: run test setup models lint clean-results lab

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

# JupyterLab on notebooks/ with the venv's kernel; LAB_ARGS go to it (e.g. --no-browser --port 8899)
lab: setup models
	$(PY) -m qlib lab $(LAB_ARGS)

lint: setup
	$(VENV)/bin/ruff check qlib tests

# Deletes everything under results/, but not committed reference results (files tracked by
# git) unless FORCE=1: with such files there it says what it would delete and fails.
clean-results:
	@tracked=$$(git ls-files -- results 2>/dev/null | while IFS= read -r f; do \
	  [ -e "$$f" ] && echo "$$f"; done); \
	all=$$(find results -mindepth 1 -type f 2>/dev/null | wc -l); \
	if [ -n "$$tracked" ] && [ "$(FORCE)" != 1 ]; then \
	  n=$$(printf '%s\n' "$$tracked" | wc -l); \
	  echo "clean-results would delete $$all file(s) under results/ (rm -rf results/*);"; \
	  echo "$$n of them are committed reference results tracked by git, e.g.:"; \
	  printf '%s\n' "$$tracked" | head -n 5 | sed 's/^/  /'; \
	  echo "Nothing deleted. 'make clean-results FORCE=1' deletes them all."; \
	  exit 1; \
	fi; \
	echo "deleting $$all file(s) under results/"; \
	rm -rf results/* results/.[!.]*
