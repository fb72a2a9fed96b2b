# Quick start: `make demo` captions the sample photos; `make test` runs the test suite.
# Both create the virtual environment and install everything on first use.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.captionkit-installed
# torch/torchvision are pinned to the releases this machine kind serves from its local disk
TORCH ?= torch==2.14.1 torchvision==0.29.1

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test]'
	@# WordNet for nltk's METEOR (used only where Java is absent); optional, needs root and apt
	-@if [ ! -f /usr/share/wordnet/data.noun ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -qq wordnet-base wordnet-sense-index >/dev/null 2>&1 || \
		{ apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq wordnet-base wordnet-sense-index >/dev/null 2>&1; } || \
		echo "note: WordNet not installed; nltk METEOR will be unavailable"; fi
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/captionkit caption samples --beam 3 --json demo-out/captions.json --attention demo-out/attention
	@echo "attention figures: demo-out/attention/"

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/speed.py
	$(BIN)/python benchmarks/scoring.py

clean:
	rm -rf demo-out .pytest_cache
