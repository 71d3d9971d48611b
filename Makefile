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

.PHONY: setup lock test test-full test-latest test-quick test-compile test-archs test-gpu lint typecheck bench limits clean

setup: $(STAMP)

comma := ,
empty :=
space := $(empty) $(empty)
EXTRA_NAMES := dev bench vision notebook hf cluster plan tensorboard data ft
EXTRAS := .[$(subst $(space),$(comma),$(EXTRA_NAMES))]
# Every third-party package `make setup` installs, at one version each (`make lock` writes it from pyproject.toml's
# ranges); pyproject.toml keeps the ranges users get. `make test` first checks the environment equals it.
LOCK := requirements.lock
UV_VERSION := 0.13.9
LATEST_VENV ?= .venv-latest

# uv installs what pip would (the newest match over every index, as pip picks) in a third of the time: pip unpacks
# torch's CUDA wheels (4 GB) on one core. uv reads none of pip's configuration, so pip's indexes and find-links are
# handed to it (and pip's constraints, except for the newest-releases tier). Where uv cannot be had, pip installs.
PIPCONF = pipconf() { $(1)/bin/python -m pip config get "global.$$1" 2> /dev/null || true; }; \
  uv_sources() { for u in $$(pipconf extra-index-url); do echo --extra-index-url $$u; done; \
                 for u in $$(pipconf find-links); do echo --find-links $$u; done; }

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(call PIPCONF,$(VENV)); \
	if $(PY) -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION) > /dev/null 2>&1; then \
	  $(VENV)/bin/uv pip install --python $(PY) --quiet --index-strategy unsafe-best-match $$(uv_sources) \
	    -r $(LOCK) && \
	  $(VENV)/bin/uv pip install --python $(PY) --quiet --no-deps -e '$(EXTRAS)'; \
	else \
	  $(PY) -m pip install --quiet --disable-pip-version-check --no-compile -r $(LOCK) 2>&1 \
	    | { grep -v "is ignored" || true; }; \
	  $(PY) -m pip install --quiet --disable-pip-version-check --no-compile --no-deps -e '$(EXTRAS)'; \
	fi
	@# The bytecode most processes need, compiled now on all cores: otherwise the suite's first processes, started
	@# together, each compile torch (and the sympy that torch.export uses) before any of them has written it.
	$(PY) -m compileall -q -j 0 $(addprefix "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"/,torch torchvision sympy) > /dev/null || true
	$(PY) tools/check_lock.py $(LOCK)
	$(PY) -c "import paratrain, torch"
	touch $(STAMP)

# the lock, resolved again from pyproject.toml's ranges (the newest releases that satisfy them, under pip's
# constraints where this machine has some); then `make setup` installs it and `make test` checks it
lock: setup
	$(call PIPCONF,$(VENV)); \
	$(VENV)/bin/uv pip compile pyproject.toml $(addprefix --extra ,$(EXTRA_NAMES)) \
	  --index-strategy unsafe-best-match $$(uv_sources) $$(for c in $$(pipconf constraint); do echo -c $$c; done) \
	  --no-annotate --custom-compile-command "make lock" --quiet -o $(LOCK)

lint: setup
	$(VENV)/bin/ruff check src tests examples benchmarks tools

typecheck: setup
	$(VENV)/bin/mypy src/paratrain

# the whole suite on two test processes (pytest-xdist; the matrix's two halves run side by side)
# mypy (one core, ~35 s from a fresh clone) runs beside the tests instead of before them; either failing fails
test: setup lint
	$(PY) tools/check_lock.py $(LOCK)
	$(VENV)/bin/mypy src/paratrain > $(VENV)/mypy.log 2>&1 & checker=$$!; status=0; \
	$(VENV)/bin/pytest -q -n 2 --dist loadscope || status=$$?; \
	wait $$checker || { status=1; echo "mypy failed:"; }; cat $(VENV)/mypy.log; exit $$status

# every cell of every grid: make test plus the extended tier (tests/conftest.py EXTENDED, test_resume_layouts.py's
# whole grid), about 22 minutes on 2 cores
test-full: setup lint
	PARATRAIN_TEST_FULL=1 $(VENV)/bin/pytest -q -n 2 --dist loadscope

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

# the newest releases: a separate environment ($(LATEST_VENV)) with the newest transformers, peft, datasets and torch
# the indexes offer (no lock, no constraints), then the quick tier and the architecture cells; the versions and the
# result go to benchmarks/results/latest-DATE.md (README's development table quotes the last one). A release that
# changes what the project relies on fails here, with the release named, before the lock moves to it.
test-latest:
	$(PYTHON) -m venv $(LATEST_VENV)
	$(call PIPCONF,$(LATEST_VENV)); \
	$(LATEST_VENV)/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION) && \
	$(LATEST_VENV)/bin/uv pip install --python $(LATEST_VENV)/bin/python --quiet --upgrade \
	  --index-strategy unsafe-best-match $$(uv_sources) -e '$(EXTRAS)' transformers peft datasets torch torchvision
	OMP_NUM_THREADS=1 $(LATEST_VENV)/bin/python tools/latest_tier.py --out benchmarks/results/latest-$$(date -u +%F).md

test-gpu: setup
	PARATRAIN_TEST_GPU=1 $(VENV)/bin/pytest -q -m gpu

bench: setup
	$(VENV)/bin/paratrain bench --out results/bench

# how close to the machine's limits (docs/benchmarks.md, section H): about 4 minutes after setup
limits: setup
	bash benchmarks/bench_limits.sh --quick results/limits

clean:
	rm -rf $(VENV) $(LATEST_VENV) results .mypy_cache .ruff_cache .pytest_cache
