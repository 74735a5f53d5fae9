# Two commands from a fresh clone:  make demo  (train the tiny recipe)  ·  make test  (the suite)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Hub access is never needed: fail at once instead of waiting on the network.
export HF_DATASETS_OFFLINE = 1
export HF_HUB_OFFLINE = 1

.PHONY: setup demo test test-fast explore clean

setup: $(STAMP)

# A CUDA machine keeps the torch it has (the venv sees the system packages); elsewhere the CPU
# build torch==2.13.0 is pinned, since an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "CUDA torch found: the venv reuses it"; python3 -m venv --system-site-packages $(VENV); \
	else \
		python3 -m venv $(VENV) && $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

demo: setup
	$(VENV)/bin/growtrain run recipes/tiny.yaml

# Two workers, a file at a time (its module fixtures built once), one thread each, the slowest files
# first in the order tests/conftest.py gives (SLOWEST_FIRST; xdist would put the files of most tests first).
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

# The suite starts hundreds of growtrain processes. Where PYTHONDONTWRITEBYTECODE is set (as on
# this project's machines) none of them caches its bytecode, and each compiles growtrain's own
# modules again (~0.3 s); compiled here once (only what changed since), they are read instead.
BYTECODE := $(PY) -m compileall -q growtrain stages kernels evals

test: setup
	$(BYTECODE)
	$(PY) -m pytest $(XDIST) --durations=20

test-fast: setup
	$(BYTECODE)
	$(PY) -m pytest $(XDIST) -m "not slow"

# The property tests with fresh examples (CI draws the same ones every run), five times as many.
explore: setup
	HYPOTHESIS_PROFILE=explore $(PY) -m pytest $(XDIST) tests/test_data.py tests/test_growth.py tests/test_growth_operators.py tests/test_kernels_combine.py -k "random_chains or random_operator_chains or resumed_stream_reproduces or plan_gives_every_tile"

clean:
	rm -rf runs .pytest_cache .hypothesis
