# `make bench` and `make test` work on a fresh clone: both create .venv first.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Bytecode is written (into .venv and the ignored __pycache__ folders) even where the environment says not to:
# with PYTHONDONTWRITEBYTECODE set, each of the suite's hundreds of processes compiles torch again (about 0.3 s
# of CPU for the project's modules alone). Compiled on first import, so only the modules in use are compiled.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: setup test test-quick test-compile test-archs test-gpu lint typecheck bench limits clean

setup: $(STAMP)

EXTRAS := .[dev,bench,vision,notebook,hf,cluster,plan,tensorboard,data]

# uv installs what pip would (the newest match over every index, as pip picks) in a third of the time: pip unpacks
# torch's CUDA wheels (4 GB) on one core. uv reads none of pip's configuration, so pip's indexes, find-links and
# constraints are handed to it. Where uv cannot be had, pip installs.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	if $(PY) -m pip install --quiet --disable-pip-version-check uv > /dev/null 2>&1; then \
	  pipconf() { $(PY) -m pip config get "global.$$1" 2> /dev/null || true; }; \
	  $(VENV)/bin/uv pip install --python $(PY) --quiet --index-strategy unsafe-best-match -c constraints.txt \
	    $$(for u in $$(pipconf extra-index-url); do echo --extra-index-url $$u; done) \
	    $$(for u in $$(pipconf find-links); do echo --find-links $$u; done) \
	    $$(for u in $$(pipconf constraint); do echo -c $$u; done) -e '$(EXTRAS)'; \
	else \
	  $(PY) -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt -e '$(EXTRAS)' 2>&1 \
	    | { grep -v "is ignored" || true; }; \
	fi
	@# The bytecode most processes need, compiled now on all cores: otherwise the suite's first processes, started
	@# together, each compile torch (and the sympy that torch.export uses) before any of them has written it.
	$(PY) -m compileall -q -j 0 $(addprefix "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"/,torch torchvision sympy) > /dev/null || true
	@# torch is imported (it must load); the extras are only found: importing peft alone takes 15 s of one core
	$(PY) -c "import importlib.util as u, sys, paratrain, torch; gone = [m for m in ('matplotlib', 'pytest', \
	  'kubernetes', 'transformers', 'peft', 'yaml', 'tensorboard', 'tqdm', 'datasets', 'pyarrow') \
	  if u.find_spec(m) is None]; \
	  sys.exit(f'not installed: {gone}') if gone else None"
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check src tests examples benchmarks

typecheck: setup
	$(VENV)/bin/mypy src/paratrain

# the whole suite on two test processes (pytest-xdist; the matrix's two halves run side by side)
# mypy (one core, ~35 s from a fresh clone) runs beside the tests instead of before them; either failing fails
test: setup lint
	$(VENV)/bin/mypy src/paratrain > $(VENV)/mypy.log 2>&1 & checker=$$!; status=0; \
	$(VENV)/bin/pytest -q -n 2 --dist loadscope || status=$$?; \
	wait $$checker || { status=1; echo "mypy failed:"; }; cat $(VENV)/mypy.log; exit $$status

# pure logic and one-rank tests: the inner loop (about a minute after setup)
test-quick: setup
	$(VENV)/bin/pytest -q -m quick -n 2

# a compile cell in every column of the correctness matrix (CI runs five of them): about 6 minutes
test-compile: setup
	PARATRAIN_MATRIX_COMPILE=all $(VENV)/bin/pytest -q -n 2 --dist loadscope tests/test_matrix.py -k every_model

# every named architecture (tests/zoo/archs.py) under every layout, and every causal LM of the installed transformers
# under ddp, fsdp, tp and pp, against the plain loop: benchmarks/results/archs-DATE.json and .md (the table), and
# the table into docs/parallelism.md
test-archs: setup
	OMP_NUM_THREADS=1 $(PY) benchmarks/archs_sweep.py --docs --out benchmarks/results/archs-$$(date -u +%F)

test-gpu: setup
	PARATRAIN_TEST_GPU=1 $(VENV)/bin/pytest -q -m gpu

bench: setup
	$(VENV)/bin/paratrain bench --out results/bench

# how close to the machine's limits (docs/benchmarks.md, section H): about 4 minutes after setup
limits: setup
	bash benchmarks/bench_limits.sh --quick results/limits

clean:
	rm -rf $(VENV) results .mypy_cache .ruff_cache .pytest_cache
