# The two commands of the README: `make node` and `make test`. Each sets up .venv first (once).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WEB := static/vendor/.built
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup node test bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: anything unpinned would pull a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]' torch==2.13.0
	$(BIN)/python -m node.assets static
	touch $(STAMP)

# the browser pages' npm dependencies (TensorFlow.js), bundled into static/vendor/: the node serves them, no CDN
$(WEB): package.json package-lock.json web/tf.js web/build.mjs
	npm ci --no-audit --no-fund --loglevel=error
	npm run --silent build
	touch $(WEB)

# the browser tests drive Debian's Chromium (a test tool's own browser download is refused on these machines)
$(CHROMIUM):
	$(SUDO) apt-get install -y -q chromium || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium)

setup: $(STAMP) $(WEB)

node: $(STAMP) $(WEB)
	$(BIN)/dtrain-node $(ARGS)

test: $(STAMP) $(WEB) $(CHROMIUM)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/bench_ingest.py
	$(BIN)/python bench/bench_download.py

clean:
	rm -rf $(VENV)
