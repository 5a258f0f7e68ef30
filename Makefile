# Two commands on a fresh machine:  `make run`  (tiny recipe end to end)  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU torch: the local 2.13.0 wheel (an unpinned torch pulls a multi-GB CUDA build). GPU: TORCH_SPEC=torch==2.14.1 EXTRAS=dev,gpu
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
WHEELS := $(wildcard /opt/wheels)
PIP_FLAGS := --disable-pip-version-check $(if $(WHEELS),--find-links $(WHEELS))
ARGS ?=

.PHONY: install run test clean

$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(PIP_FLAGS) --upgrade pip
	$(BIN)/python -m pip install -q $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q $(PIP_FLAGS) -e ".[$(EXTRAS)]" "$(TORCH_SPEC)"
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/kimi run $(ARGS)

test: install
	$(BIN)/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV) .prefect runs
