# One tool stack: every target runs inside .venv, created on first use with the newest
# Python 3.12+ on the machine and the newest JAX (the tested platform). .venv-oldest holds
# the oldest supported release (Python 3.11, the lower bounds in pyproject.toml exactly),
# for `make test-oldest`.
PY        := .venv/bin/python
STAMP     := .venv/.installed
OLD_PY    := .venv-oldest/bin/python
OLD_STAMP := .venv-oldest/.installed
CONFIG    ?= configs/tiny.py
WORKDIR   ?= runs/demo
# Empty: the newest Python 3.12+ found (pyenv's versions and the PATH's), else python3.
PYTHON    ?=
OLDEST_PYTHON ?= $(firstword $(wildcard $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/3.11*/bin/python3) python3.11)

.PHONY: install install-oldest which-python train test test-shard test-oldest test-oracles test-all budgets budgets-update lint bench bench-accelerator bench-device clean

# Each candidate prints "<minor> <path>" when it is a final CPython 3.12+ release with venv
# and ensurepip and without the free-threaded build (no wheels for that); a pyenv shim of
# a version not selected fails and prints nothing.
NEWEST_PYTHON = for c in $${PYENV_ROOT:-$$HOME/.pyenv}/versions/*/bin/python3 \
	    $$(command -v python3.14 python3.13 python3.12 2>/dev/null); do \
	  "$$c" -c 'import ensurepip, sys, sysconfig, venv; v = sys.version_info; \
	    ok = v >= (3, 12) and v.releaselevel == "final" and not sysconfig.get_config_var("Py_GIL_DISABLED"); \
	    ok and print("%03d %s" % (v.minor, sys.executable))' 2>/dev/null; \
	done | sort -r | head -n 1 | cut -d " " -f 2-

# JAX's CUDA plugin (no CUDA libraries) outside site-packages: it compiles for NVIDIA GPUs
# from any Linux machine (--compile_only --topology h200-8, and the tests), and jax does
# not look for a GPU at every start. $(1): the venv.
define cuda_compiler
	if [ "$$(uname -s)" = Linux ]; then V=$$($(1)/bin/python -c 'import jax; print(jax.__version__)'); \
	  $(1)/bin/python -m pip install -q --no-deps --upgrade --target $(1)/cuda-compiler \
	    "jax-cuda13-plugin==$$V" "jax-cuda13-pjrt==$$V"; fi
endef

install: $(STAMP)

PICK_PYTHON = py="$(PYTHON)"; [ -n "$$py" ] || py=$$($(NEWEST_PYTHON)); py=$${py:-python3}

# The interpreter `make install` builds .venv with.
which-python:
	@$(PICK_PYTHON); echo "$$py"

$(STAMP): pyproject.toml
	@$(PICK_PYTHON); echo "make install: $$py, $$($$py -V)"; $$py -m venv --clear .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(call cuda_compiler,.venv)
	touch $(STAMP)

# The JAX stack at the lower bounds pyproject.toml declares, each pinned exactly, so that
# those bounds are what CI tests; the dev extra picks jax[tpu] 0.10.2's libtpu on 3.11, and
# the oracle extra torch 2.13.0 (a CPU build on 3.11) and transformers for make test-oracles.
install-oldest: $(OLD_STAMP)

$(OLD_STAMP): pyproject.toml
	$(OLDEST_PYTHON) -m venv --clear .venv-oldest
	$(OLD_PY) -m pip install -q --upgrade pip
	$(OLD_PY) -c 'import re, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	  [print(d.replace(">=", "==")) for d in p["dependencies"] + p["optional-dependencies"]["dev"] \
	   if re.match(r"(jax|flax|optax|orbax-checkpoint|grain|chex)>=", d)]' > .venv-oldest/lower-bounds.txt
	$(OLD_PY) -m pip install -q -e '.[dev,oracle]' -c .venv-oldest/lower-bounds.txt
	$(call cuda_compiler,.venv-oldest)
	touch $(OLD_STAMP)

train: $(STAMP)
	$(PY) train.py --config $(CONFIG) --workdir $(WORKDIR)

# The default suite: every test not marked slow (nor transformers, make test-oracles').
test: $(STAMP)
	$(PY) -m pytest -n 2 -q --durations=25

# The slow tests in SHARDS deterministic shards (a test's shard: CRC-32 of its id mod
# SHARDS); SHARD=i/SHARDS runs one. CI runs the shard of its commit (docs/testing.md).
SHARDS ?= 24
SHARD  ?= 0/$(SHARDS)
test-shard: $(STAMP)
	$(PY) -m pytest -n 2 -q -m 'slow and not transformers' --shard=$(SHARD) --durations=10

# The smoke subset on the oldest supported release: the oracle sample, a training run,
# a resume, a TPU compile (tests marked `oldest`).
test-oldest: $(OLD_STAMP)
	$(OLD_PY) -m pytest -n 2 -q -m 'oldest and not slow'

# The live oracles (tests marked `transformers`): transformers itself, run here and now, on
# the Python 3.11 stack, where torch has a CPU build; a missing library fails, not skips.
test-oracles: $(OLD_STAMP)
	$(OLD_PY) -m pytest -n 2 -q -m transformers

# Every test but the live oracles, in one run (hours on 2 cores; CI runs it by shards).
test-all: $(STAMP)
	$(PY) -m pytest -n 2 -q -m 'not transformers'

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
