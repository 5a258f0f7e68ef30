# SGLang's own environment (requirements-sglang.txt: sglang pins its own torch, transformers and compressed-tensors,
# which cannot share the trainer's environment). The trainer image copies its venv in; it also serves as the image
# of an engine-only pod. Build with `make images`, which passes every ARG (none has a default here, so nothing can
# drift from the Makefile).
ARG CUDA_IMAGE
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git make ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kimi-pipeline
COPY Makefile pyproject.toml requirements-sglang.txt ./
# the Makefile's own target: the same pins `make install EXTRAS=...,gpu` installs on a GPU machine
RUN make sglang-env PYTHON=python3
ENV PATH=/opt/kimi-pipeline/.venv-sglang/bin:${PATH}
