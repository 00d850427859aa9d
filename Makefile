# The two commands of the README: `make node` and `make test`. Each sets up .venv first (once).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup node test bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: anything unpinned would pull a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]' torch==2.13.0
	$(BIN)/python -m node.assets static
	touch $(STAMP)

setup: $(STAMP)

node: $(STAMP)
	$(BIN)/dtrain-node $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/bench_ingest.py
	$(BIN)/python bench/bench_download.py

clean:
	rm -rf $(VENV)
