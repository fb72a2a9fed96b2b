# Quick start: `make demo` captions the sample photos; `make test` runs the test suite
# (`make test-fast` all but the tests marked slow; `make lint` runs ruff and lint-imports).
# Both create the virtual environment and install everything on first use.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.captionkit-installed
# torch/torchvision are pinned to the releases this machine kind serves from its local disk
TORCH ?= torch==2.14.1 torchvision==0.29.1

WEB_VENDOR := src/captionkit/web/vendor/ort/ort.wasm.min.mjs

.PHONY: demo test test-fast lint bench clean web

$(STAMP): pyproject.toml
	@echo "setting up $(VENV): PyTorch and the rest, a few minutes on first use" >&2
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -qq $(TORCH)
	@$(BIN)/python -m pip install -qq -e '.[test,ray]'
	@# WordNet for nltk's METEOR (used only where Java is absent); optional, needs root and apt
	-@if [ ! -f /usr/share/wordnet/data.noun ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -qq wordnet-base wordnet-sense-index >/dev/null 2>&1 || \
		{ apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq wordnet-base wordnet-sense-index >/dev/null 2>&1; } || \
		echo "note: WordNet not installed; nltk METEOR will be unavailable"; fi
	@# Chromium for the browser tests (Debian's package; Playwright drives it, downloads nothing)
	-@if ! command -v chromium >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -qq chromium >/dev/null 2>&1 || \
		{ apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; } || \
		echo "note: chromium not installed; the browser tests will be skipped"; fi
	@# Node.js and npm build the in-browser demo's runtime (onnxruntime-web)
	-@if ! command -v npm >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -qq nodejs npm >/dev/null 2>&1 || \
		{ apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq nodejs npm >/dev/null 2>&1; } || \
		echo "note: npm not installed; the in-browser demo will not be built"; fi
	@touch $(STAMP)

# onnxruntime-web from npm, copied into the package's static folder (not committed)
$(WEB_VENDOR): web/package.json web/package-lock.json web/build.mjs
	cd web && npm ci --no-audit --no-fund && npm run build

web: $(WEB_VENDOR)

demo: $(STAMP)
	@$(BIN)/captionkit caption samples/*.jpg --beam 3 --json demo-out/captions.json --attention demo-out/attention --overwrite
	@echo "attention figures: demo-out/attention/"

# The suite in TEST_WORKERS processes (pytest-xdist; tests/conftest.py gives each its share of
# the cores' threads), each taking the next test as it finishes one (worksteal). Most tests are
# single-threaded Python and child processes: on 2 cores, 2 workers take about two thirds of
# one process's time. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

test: $(STAMP)
	-@command -v npm >/dev/null && $(MAKE) --no-print-directory web || echo "note: npm missing; in-browser demo tests will be skipped"
	$(PYTEST)

# the loop while editing: every test not marked @pytest.mark.slow (make test, as CI, runs them all)
test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

# ruff's rules and line length are in pyproject.toml ([tool.ruff]); the import-linter contracts
# (the wings' layers, scoring without torch) in [tool.importlinter]
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/python benchmarks/speed.py
	$(BIN)/python benchmarks/scoring.py

clean:
	rm -rf demo-out .pytest_cache
