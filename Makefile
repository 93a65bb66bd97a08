# make setup [GPU=1] | make demo | make test | make bench | make lint | make docs (the guide, strict, into site/)
# make bench: BENCHMARKS.md (<= 25 min); BENCH_QUICK=1 make bench: the smoke run; BENCH_REPEATS=N
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2
# pytest-xdist workers for make test (a file at a time each; most tests launch 2-4 ranks themselves)
TEST_WORKERS ?= 2

.PHONY: setup demo test test-unit bench lint docs clean

setup:
	VENV=$(VENV) GPU=$(GPU) scripts/setup.sh

demo: setup
	$(VENV)/bin/hvtrain launch -np $(NP) --hostfile hostfiles/localhost -- train examples/digits_mlp.yaml

# the suite is hardware-independent (CUDA_VISIBLE_DEVICES=): scripts/gpu_check.sh is the GPU's
test: setup
	CUDA_VISIBLE_DEVICES= PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

test-unit: setup
	CUDA_VISIBLE_DEVICES= $(PY) -m pytest -q tests/unit

bench: setup
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) bench/run.py

lint: setup
	$(VENV)/bin/ruff check hvtrain backends tests bench

docs: setup
	$(VENV)/bin/mkdocs build --strict --quiet -d site

clean:
	rm -rf runs .pytest_cache site
