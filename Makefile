# Two entry points: `make demo` (set up, make demo posts, run the pipeline) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Debian packages the pipeline uses (installed when missing and we are root); the tests also need
# chromium, which opens Label Studio's labelling page in tests/test_labelstudio_live.py.
DEBIAN_PACKAGES := ffmpeg espeak-ng
TEST_DEBIAN_PACKAGES := $(DEBIAN_PACKAGES) chromium
SLURM_PACKAGES := munge slurmctld slurmd slurm-client slurmdbd mariadb-server

.PHONY: setup system-packages demo test test-fast clean

system-packages:
	@missing=""; for p in $(PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  else echo "Please install:$$missing (e.g. sudo apt-get install$$missing)"; exit 1; fi; \
	fi

# torch first (a CPU build where one is available), then openai-whisper without its CUDA-only
# triton dependency, then the package with its test extras.
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip wheel
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,speed,bench]" "tiktoken>=0.7" "numba>=0.59" "more-itertools>=10"
	$(BIN)/pip install -q --no-deps "openai-whisper>=20240930"
	touch $@

setup: system-packages $(BIN)/.installed

# The demo needs only the pipeline's packages; the tests add theirs (inherited by setup's prerequisites).
PACKAGES = $(DEBIAN_PACKAGES)
test test-fast: PACKAGES = $(TEST_DEBIAN_PACKAGES)

demo: setup
	$(BIN)/python -m vidlabel.cli demo

test: setup
	@if [ "$$(id -u)" = 0 ] && [ -f /etc/debian_version ]; then bash .ci/slurm-cluster.sh start; \
	else echo "SLURM tests need root on Debian to start the local cluster; set VIDLABEL_SLURM_TESTS=0 and VIDLABEL_SLURM_TESTS_REASON=... to skip them, or run make test-fast"; fi
	$(BIN)/pytest -q

# Everything but the SLURM cluster tests.
test-fast: setup
	VIDLABEL_SLURM_TESTS=0 $(BIN)/pytest -q -m "not slurm"

clean:
	rm -rf results logs .snakemake demo/data
