# `make bench` and `make test` work on a fresh clone: both create .venv first.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-quick test-gpu lint typecheck bytecode bench limits clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt -e '.[dev,bench,vision,notebook,hf,cluster,plan,tensorboard]' 2>&1 | { grep -v "is ignored" || true; }
	@# Bytecode for every installed module, compiled on all cores at once (pip compiles one file at a time).
	@# Without it a machine with PYTHONDONTWRITEBYTECODE set recompiles torch in every process; files that
	@# are not Python 3 (templates, fixtures) fail to compile, as they do under pip, and are skipped.
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	$(PY) -c "import paratrain, torch, matplotlib, pytest, kubernetes, transformers, yaml, tensorboard, tqdm" 
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check src tests examples benchmarks

typecheck: setup
	$(VENV)/bin/mypy src/paratrain

# the whole suite on two test processes (pytest-xdist; the matrix's two halves run side by side)
test: setup lint typecheck bytecode
	$(VENV)/bin/pytest -q -n 2 --dist loadscope

# the project's own modules compiled once, so the suite's hundreds of processes read them instead of each
# compiling them again where PYTHONDONTWRITEBYTECODE is set (about 0.3 s of CPU a process)
bytecode: setup
	$(PY) -m compileall -q -j 0 src tests examples benchmarks > /dev/null

# pure logic and one-rank tests: the inner loop (about a minute after setup)
test-quick: setup bytecode
	$(VENV)/bin/pytest -q -m quick

test-gpu: setup
	PARATRAIN_TEST_GPU=1 $(VENV)/bin/pytest -q -m gpu

bench: setup
	$(VENV)/bin/paratrain bench --out results/bench

# how close to the machine's limits (docs/benchmarks.md, section H): about 4 minutes after setup
limits: setup
	bash benchmarks/bench_limits.sh --quick results/limits

clean:
	rm -rf $(VENV) results .mypy_cache .ruff_cache .pytest_cache
