# moetier developer targets. Each one first makes sure .venv is set up
# (scripts/setup_env.sh; see its header for the torch policy and variables).
#   make demo        generate 32 tokens with the built-in model
#   make test        fast suite (pyproject addopts deselect `slow`)
#   make test-slow   only the `slow` tests
#   make test-all    everything but the peer tests, slow included
#   make test-peer   the tests against llama.cpp (marker `peer`): installs the `peer` extra first
#                    (llama-cpp-python builds llama.cpp from source: ~13 min on 2 cores once, then pip's cache)
#   make bench       benchmarks/bench_decode.py
#   make setup       re-run the setup check now;  make clean  remove .venv and caches
# PYTEST_ARGS adds pytest options, e.g. make test PYTEST_ARGS='-k router -x'.

VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.moetier-setup
PYTEST_ARGS ?=

PEER_STAMP := $(VENV)/.moetier-peer

.PHONY: setup demo test test-slow test-all test-peer bench clean

# The script writes (or touches) the stamp only on success, so make reruns it
# whenever pyproject.toml or the script is newer than the last good setup.
$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh

setup:
	bash scripts/setup_env.sh

demo: $(STAMP)
	$(VENV)/bin/moetier run --max-new-tokens 32

# pytest's exit code 5 means it collected no tests: a failure here, with a word.
define run_pytest
	echo "$(PY) -m pytest $(1) $(PYTEST_ARGS)"; \
	$(PY) -m pytest $(1) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make: pytest collected no tests (exit code 5): counted as a failure" >&2; fi; \
	exit $$rc
endef

test: $(STAMP)
	@$(call run_pytest,)

test-slow: $(STAMP)
	@$(call run_pytest,-m slow)

# -m overrides addopts' "-m 'not slow and not peer'": only the peer tests are deselected.
test-all: $(STAMP)
	@$(call run_pytest,-m 'not peer')

# The peer extra pins llama-cpp-python; multimodal support is not built (LLAVA_BUILD=OFF).
$(PEER_STAMP): $(STAMP) pyproject.toml
	CMAKE_ARGS="-DLLAVA_BUILD=OFF $$CMAKE_ARGS" $(PY) -m pip install -e '.[peer]'
	touch $@

test-peer: $(PEER_STAMP)
	@$(call run_pytest,-m peer)

bench: $(STAMP)
	$(PY) benchmarks/bench_decode.py

clean:
	rm -rf $(VENV) .venv.lock build dist .pytest_cache .hypothesis *.egg-info
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
