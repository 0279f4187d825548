# One tool stack: every target runs inside .venv, created on first use.
PY      := .venv/bin/python
STAMP   := .venv/.installed
CONFIG  ?= configs/tiny.py
WORKDIR ?= runs/demo

.PHONY: install train test test-all budgets budgets-update lint bench bench-accelerator bench-device clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@# JAX's CUDA plugin (no CUDA libraries) outside site-packages: it compiles for NVIDIA
	@# GPUs from any Linux machine (--compile_only --topology h200-8, and the tests), and
	@# jax does not look for a GPU at every start.
	if [ "$$(uname -s)" = Linux ]; then V=$$($(PY) -c 'import jax; print(jax.__version__)'); \
	  $(PY) -m pip install -q --no-deps --upgrade --target .venv/cuda-compiler \
	    "jax-cuda13-plugin==$$V" "jax-cuda13-pjrt==$$V"; fi
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py --config $(CONFIG) --workdir $(WORKDIR)

test: $(STAMP)
	$(PY) -m pytest -n 2 -q

test-all: $(STAMP)
	$(PY) -m pytest -n 2 -q -m ''

# Memory budgets (tests/memory_budgets.json): every row, the paper-size ones included (an
# hour or more on 2 cores); a rise over a budget exits 1. budgets-update rewrites the file
# with what was measured (ROWS=name,name for some rows only): commit it with the change.
budgets: $(STAMP)
	$(PY) -m seqpipe.tools.budgets $(if $(ROWS),--only $(ROWS))

budgets-update: $(STAMP)
	$(PY) -m seqpipe.tools.budgets --update $(if $(ROWS),--only $(ROWS))

lint: $(STAMP)
	$(PY) -m ruff check seqpipe tests configs train.py
	$(PY) -m ruff format --check seqpipe tests configs train.py

bench: $(STAMP)
	$(PY) -m seqpipe.bench --json runs/bench.json --png docs/bench.png

# The train step on the device JAX sees (gpt_1b; on CPU add ACCEL_ARGS=--quick).
bench-accelerator: $(STAMP)
	$(PY) -m seqpipe.bench --accelerator --json runs/accelerator.json $(ACCEL_ARGS)

# On the device machine (docs/performance.md): gpt_1b, every variant, then the extras;
# through the `run` tool, one call each: bash scripts/device_accel.sh bench|long|extras.
bench-device:
	bash scripts/device_accel.sh all

clean:
	rm -rf runs .pytest_cache
