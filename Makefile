# Two commands on a fresh machine:  `make run`  (tiny recipe end to end)  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU torch: the local 2.13.0 wheel (an unpinned torch pulls a multi-GB CUDA build). GPU: TORCH_SPEC=$(CUDA_TORCH_SPEC)
# EXTRAS=dev,gpu (the GPU torch below; the trainer image installs the same). Packages built from source
# (transformer_engine_torch: sdist only) build against the same torch: install constraints do not reach build
# environments, --build-constraints does.
TORCH_SPEC ?= torch==2.13.0
CUDA_TORCH_SPEC := torch==2.14.1
EXTRAS ?= dev
WHEELS := $(wildcard /opt/wheels)
FIND_LINKS := $(if $(WHEELS),--find-links $(WHEELS))
PIP_FLAGS := --disable-pip-version-check $(FIND_LINKS)
# The trainer's environment is installed by uv (pinned below, put into the venv by the venv's own pip): it resolves,
# fetches and unpacks in parallel, where pip does one package after another. Measured on 2 cores (2026-11-29): torch
# 3.3 s instead of 11.8, the ~190 other packages 9.6 s instead of 31.6 (an empty uv cache; less with a warm one),
# the same versions (`uv pip freeze` = `pip freeze`). pip stays in the venv for those who use it, and for SGLang's own
# environment on GPU machines.
UV_VERSION := 0.13.9
UV := $(BIN)/uv
UV_INSTALL := pip install -q -p $(BIN)/python $(FIND_LINKS)
# Neither installer byte-compiles here: each tree is compiled once with `compileall -j 0` (every core; pip did it
# file by file in its one process, 50 of the 116 s its install took). Like pip, it skips a file this Python cannot
# compile (torch ships a Python 3.12-only test helper): such a file is never imported here, so compileall's exit
# status 1 for it is not an error. The packages' own test suites (`tests/`, `test/` inside an installed package:
# pandas', sympy's, numpy's ..., 12 % of the venv's Python) are left out: nothing imports them. (Matched below the
# install directory, never in the checkout's path.)
COMPILE := -m compileall -qq -j 0 -x '(site-packages|sglang-parser)/.+/tests?/'
ARGS ?=
# SGLang's own environment (GPU machines): its exact pins (transformers, compressed-tensors, torch) cannot share
# one environment with the trainer's; sglang.python / $$KIMI_SGLANG_PYTHON default to it.
SGLANG_VENV ?= .venv-sglang
# SGLang's launch-argument parser on CPU, for the tests only: sglang + what its parser imports, --no-deps.
SGLANG_PARSER := .cache/sglang-parser

.PHONY: install run test test-fast clean browser gpu-check sglang-env sglang-parser trainer-env images bytecode

$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(PIP_FLAGS) --upgrade pip "uv==$(UV_VERSION)"
	$(UV) $(UV_INSTALL) "$(TORCH_SPEC)"
	mkdir -p .cache && echo "$(TORCH_SPEC)" > .cache/build-constraints.txt
	$(UV) $(UV_INSTALL) --build-constraints .cache/build-constraints.txt -e ".[$(EXTRAS)]" "$(TORCH_SPEC)"
	$(BIN)/python $(COMPILE) "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
	touch $@

install: $(BIN)/.installed $(if $(findstring gpu,$(EXTRAS)),sglang-env)

# The trainer's environment alone (the trainer image: SGLang's comes from its own image).
trainer-env: $(BIN)/.installed

$(SGLANG_VENV)/.installed: requirements-sglang.txt
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q $(PIP_FLAGS) --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q $(PIP_FLAGS) -r requirements-sglang.txt
	touch $@

sglang-env: $(SGLANG_VENV)/.installed

$(SGLANG_PARSER)/.installed: requirements-sglang.txt tests/sglang-parser.txt $(BIN)/.installed
	rm -rf $(SGLANG_PARSER)
	$(UV) $(UV_INSTALL) --no-deps --target $(SGLANG_PARSER) -r requirements-sglang.txt -r tests/sglang-parser.txt
	$(BIN)/python $(COMPILE) $(SGLANG_PARSER) || true
	touch $@

sglang-parser: $(SGLANG_PARSER)/.installed

# This project's own sources byte-compiled, as pip compiles every package it installs (not an editable one's):
# where PYTHONDONTWRITEBYTECODE=1 (this CI image sets it) no process writes a .pyc, so each of the hundreds a run or
# the suite starts (Ray actors, ranks, agents) would compile every module of ours it imports, ~0.25 CPU-s each.
# Incremental: only sources newer than their .pyc.
bytecode: install
	$(BIN)/python -m compileall -q -j 0 kimi_pipeline flows tasks tests bench

run: install bytecode
	$(BIN)/kimi run $(ARGS)

# Headless Chromium for the Prefect UI test (tests/integration/test_deployment.py): Debian's `chromium`, installed with apt
# only when missing. Never fails the suite: without a browser that test skips and says why. Without recommends: 19
# packages, not 108 (avahi, cups, samba, upower, udev: daemons a headless screenshot never uses); 8 s instead of 13 s
# on a fresh Debian 12 box (2026-11-29). The page's text renders in the image's DejaVu fonts.
APT_CHROMIUM := env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "note: no chromium and no apt-get: the browser test will skip"; \
	else SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n" ); \
	  echo "installing chromium (apt) for the browser test..."; \
	  ( $$SUDO $(APT_CHROMIUM) >/dev/null 2>&1 \
	    || ( $$SUDO apt-get update -q >/dev/null 2>&1 && $$SUDO $(APT_CHROMIUM) >/dev/null 2>&1 ) ) \
	  || echo "note: could not install chromium with apt: the browser test will skip"; fi

# Two pytest-xdist workers: whole files to a worker (their module fixtures are made once), heaviest first
# (tests/conftest.py: HEAVIEST_FIRST): 50 min of pytest instead of 65 on 2 cores. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# --cpu-report: after the 25 slowest tests, the session's CPU by kind of process (tests/support/cpu_report.py).
test: install browser sglang-parser bytecode
	KIMI_SGLANG_PARSER_PATH=$(CURDIR)/$(SGLANG_PARSER) $(BIN)/python -m pytest $(XDIST) --cpu-report $(ARGS)

# The inner loop while developing: the unit tests and the integration tests of a few seconds each (those that start
# clusters, many processes, served runs or the tiny run are marked `slow`); `make test` runs everything, as CI does.
test-fast: install sglang-parser bytecode
	KIMI_SGLANG_PARSER_PATH=$(CURDIR)/$(SGLANG_PARSER) $(BIN)/python -m pytest -m "not slow" $(ARGS)

# GPU machines only: preflight (CUDA + megatron-core, else exit 1 naming what is missing), `pytest -m gpu tests/gpu`,
# the GPU benchmarks, then gpu-check.json / gpu-check.md in the repo root (bench/gpu_check.py). Installs nothing:
# run `make install TORCH_SPEC=torch==2.14.1 EXTRAS=dev,gpu` first.
gpu-check:
	@test -x $(BIN)/python || { echo "gpu-check: no $(BIN)/python: run 'make install TORCH_SPEC=torch==2.14.1 EXTRAS=dev,gpu' first" >&2; exit 1; }
	$(BIN)/python bench/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .cache .prefect runs

# The cluster's container images (infra/docker), built here only where docker exists (not in CI): SGLang's own
# environment (requirements-sglang.txt) and the trainer image the KubeRay manifests name (kimi-pipeline:<version>:
# CUDA_TORCH_SPEC, the `gpu` extra, this package, SGLang's environment copied in). Both install through the targets
# above, so an image cannot drift from `make install` (tests/unit/test_images.py). CUDA_IMAGE's CUDA major is the
# one CUDA_TORCH_SPEC's wheels use (tests/integration/test_gpu_install_resolves.py); both images share it, so
# SGLang's venv runs unchanged in the trainer image.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
SGLANG_VERSION := $(shell sed -n 's/^sglang==//p' requirements-sglang.txt)
CUDA_IMAGE ?= nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04
IMAGE ?= kimi-pipeline:$(VERSION)
SGLANG_IMAGE ?= kimi-sglang:$(SGLANG_VERSION)

images:
	@command -v docker >/dev/null 2>&1 || { echo "make images: docker not found (the images are built where docker runs; CI here does not build them)" >&2; exit 1; }
	docker build -f infra/docker/sglang.Dockerfile --build-arg CUDA_IMAGE=$(CUDA_IMAGE) -t $(SGLANG_IMAGE) .
	docker build -f infra/docker/trainer.Dockerfile --build-arg CUDA_IMAGE=$(CUDA_IMAGE) \
	  --build-arg SGLANG_IMAGE=$(SGLANG_IMAGE) --build-arg TORCH_SPEC=$(CUDA_TORCH_SPEC) -t $(IMAGE) .
