# The two commands of the README: `make demo` and `make test`. Both build .venv on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo demo-tasks test test-heavy test-all test-fast bench install install-test clean

$(VENV)/.core-installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e .
	touch $@

$(VENV)/.test-installed: pyproject.toml $(VENV)/.core-installed
	# torch first, by exact version: that CPU build lies on the machine's disk (any other version downloads GBs).
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	# The report test renders report.html in headless Chromium (Debian's package; needs root or sudo).
	command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y chromium; } || echo "warning: could not install chromium; browser tests will skip unless JAXRL_REQUIRE_BROWSER=1"
	touch $@

install: $(VENV)/.core-installed
install-test: $(VENV)/.test-installed

demo: $(VENV)/.core-installed
	$(PY) -m launchers.demo --workdir=demo_workdir

# A reasoning-gym task (spell_backward) learned by the tiny model: SFT, then GRPO and on-policy distillation, each
# selected on dev and confirmed on held-out (jaxrl/demo_tasks.py). Needs the optional extra reasoning-gym.
demo-tasks: $(VENV)/.core-installed
	$(PY) -c "import reasoning_gym" 2>/dev/null || $(PIP) install -e '.[tasks]'
	$(PY) -m launchers.demo_tasks --workdir=demo_tasks_workdir

# One XLA compilation cache per test run, shared by both workers and every subprocess: tests that restart a run
# (resume, sweeps, launchers) or build the same tiny model compile each program once (a fresh folder each run).
# Tests compile far more than they compute, so LLVM runs at -O0: the tiny model's forward then compiles in 4 s
# instead of 18 s. Every comparison in the suite has a tolerance or compares two runs under the same flags.
# 8 fake CPU devices so sharding is exercised on any machine; tests that need one device still get device 0.
# (Only the tests: `make demo` runs on the machine's real devices, as `python -m launchers.demo` does.)
TEST_XLA_FLAGS := $(XLA_FLAGS) --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0
define run_pytest
	cache=$$(mktemp -d -t jaxrl-test-xla-cache.XXXXXX) && trap 'rm -rf "$$cache"' EXIT && \
	XLA_FLAGS='$(TEST_XLA_FLAGS)' JAX_COMPILATION_CACHE_DIR=$$cache $(PY) -m pytest $(PYTEST_ARGS) $(1) tests
endef

# Three tiers (pyproject.toml's markers): `make test` is everything but the minutes-long proofs
# (@pytest.mark.heavy: two-process runs, real widths, the demo end to end), `make test-heavy` is those, and CI
# (.ci/run) runs both; `make test-fast` also skips the tests over ~5 s (@pytest.mark.slow); `make test-all` = all.
test: $(VENV)/.test-installed
	$(call run_pytest,-m "not heavy")

test-heavy: $(VENV)/.test-installed
	$(call run_pytest,-m heavy)

test-all: $(VENV)/.test-installed
	$(call run_pytest,)

test-fast: $(VENV)/.test-installed
	$(call run_pytest,-m "not slow and not heavy")

bench: $(VENV)/.test-installed
	$(PY) -m benchmarks.run_all

clean:
	rm -rf demo_workdir demo_tasks_workdir bench_out .pytest_cache
