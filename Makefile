# Set-up is part of every target: each creates .venv on first use (CPU torch, pinned).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint verify bench device-check clean

$(STAMP): pyproject.toml requirements-ci.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-ci.txt
	$(PY) -m pip install -q -e '.[test,train,digits]'
	touch $(STAMP)

# Sinusoid MAML (Finn et al. 2017), 5000 steps on 2 local processes (1-2 minutes on 2 cores);
# prints the meta-test MSE before and after adaptation and where the plots are. runs/demo is the demo's own folder (--force).
demo: $(STAMP)
	$(VENV)/bin/metaddp train sinusoid --nproc 2 --layout task --steps 5000 --eval-every 1000 \
		--out runs/demo --force

# Every scenario at 1, 2 and 4 processes against 1; then deterministic mode: the same bits at
# every world size, meta-gradients and a 100-step training run (also resumed at another count);
# then elastic runs under torchrun that lose one of two machines, the README's glyphs run and
# the whole algorithm x mode matrix at 3 processes (make test runs a third of it there).
verify: $(STAMP)
	$(VENV)/bin/metaddp verify
	$(VENV)/bin/metaddp verify --deterministic
	METADDP_ELASTIC=1 METADDP_SLOW=1 $(PY) -m pytest -q tests/test_elastic.py tests/test_docs.py tests/test_matrix.py

test: $(STAMP)
	$(PY) -m pytest -q

# ruff's lint rules on src/, tests/, benchmarks/ and examples/ (tests and benchmarks: their own
# ruff.toml, 120 columns), ruff's formatting and mypy on src/ (settings in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src
	$(VENV)/bin/mypy

# The CPU benchmark set (BENCHMARKS.md): peers side by side, scaling, sharded, TTT-E2E at scale
# (predicted from CPU counts), cost growth, plots.
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/peers.py --json benchmarks/results/peers.json
	$(PY) benchmarks/scaling.py --json benchmarks/results/scaling.json
	$(PY) benchmarks/sharded.py --json benchmarks/results/sharded.json
	$(PY) benchmarks/ttt_scale.py --json benchmarks/results/ttt_scale.json
	$(PY) benchmarks/growth.py --json benchmarks/results/growth.json
	$(PY) benchmarks/check_cost.py --json benchmarks/results/check_cost.json
	$(PY) benchmarks/plots.py benchmarks/results

# The GPU check (BENCHMARKS.md), here on the CPU at small sizes; on a GPU machine run
# benchmarks/device.sh OUT (under 8 minutes).
device-check: $(STAMP)
	PYTHON=$(PY) bash benchmarks/device.sh runs/device-check --device cpu --quick

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
