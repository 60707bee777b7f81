# Entry points: `make demo`, `make test`, `make lint`, `make bench`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DIR ?= .demo
DEMO_LISTEN ?= 127.0.0.1:8750

.PHONY: deps deps-test demo test lint bench bench-fs bench-checkpoint bench-repos bench-dirmode bench-stopsignal clean

$(VENV)/.installed: pyproject.toml fsagent/_lstat.c controller/storage/_objfile.c packaging/pyfuse3/pyfuse3-3.5.0-fsagent.patch
	packaging/install-deps.sh
	@if [ ! -x $(PY) ]; then python3 -m venv $(VENV); fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# pyfuse3 with fsagent's patch (packaging/pyfuse3/README.md): fewer FUSE round trips.
	packaging/pyfuse3/build.sh --python $(PY) --install
	touch $@

deps: $(VENV)/.installed

deps-test: deps
	packaging/install-deps.sh --test

demo: deps
	packaging/install-deps.sh --demo
	$(PY) -m controller.demo --data-dir $(DEMO_DIR) --home demo-home --listen $(DEMO_LISTEN)

# Two workers, each taking whole test files (module fixtures stay shared);
# PYTEST_WORKERS=0 runs everything in one process. A worker that dies ends the
# run, naming its test: xdist would run that test again on the other worker and,
# with --dist loadfile, then wait forever (tests/meta/test_support.py).
PYTEST_WORKERS ?= 2
PYTEST_XDIST = --dist loadfile --max-worker-restart=0
test: deps-test
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_XDIST) $(PYTEST_ARGS)

lint: deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

bench: deps
	$(PY) -m bench.api_bench

bench-fs: deps
	packaging/install-deps.sh --bench
	$(PY) -m bench.fsops

bench-checkpoint: deps
	$(PY) -m bench.checkpoint

# Repository checkpoints and restores against the naive way (bench/repos.py).
bench-repos: deps
	$(PY) -m bench.repos

# Dir mode (plain directories where FUSE is unavailable): 10 changes saved in
# 10,000 and 99,900 files, beside FUSE and a full scan hashing every file.
bench-dirmode: deps
	$(PY) -m bench.dirmode

# How long `fsagent up` runs before a stop signal is a clean stop, beside the
# interpreter's own start-up (bench/stopsignal.py).
bench-stopsignal: deps
	$(PY) -m bench.stopsignal

# The lifecycle explorer (tests/support/explorer.py): random schedules of a
# run's life against the real `fsagent up` and controller, each checked
# against the model of what must be saved; one JSON line per schedule, also
# appended to $(EXPLORE_RECORD). `make test` runs a few fixed seeds and one random.
# EXPLORE_JOBS runs schedules side by side, each job with its own PostgreSQL
# and controller.
EXPLORE_SCHEDULES ?= 100
EXPLORE_SECONDS ?= 0
EXPLORE_JOBS ?= 1
EXPLORE_RECORD ?= explore-record.jsonl
.PHONY: explore
explore: deps-test
	$(PY) -m tests.support.explorer --schedules $(EXPLORE_SCHEDULES) --jobs $(EXPLORE_JOBS) \
		--seconds $(EXPLORE_SECONDS) --record $(EXPLORE_RECORD) $(EXPLORE_ARGS)

# Coverage-guided fuzzing of the upload frame reader and the checkpoint and
# repository checkpoint parsers
# (tests/fuzz/fuzz_upload.py); `make test` runs the same target for 5 s.
FUZZ_SECONDS ?= 600
FUZZ_CORPUS ?= .fuzz-corpus
.PHONY: fuzz
fuzz: deps
	mkdir -p $(FUZZ_CORPUS)/artifacts
	$(PY) tests/fuzz/fuzz_upload.py -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=1024 \
		-timeout=10 -artifact_prefix=$(FUZZ_CORPUS)/artifacts/ $(FUZZ_CORPUS)/inputs

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache .mypy_cache .ruff_cache
