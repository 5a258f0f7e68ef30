# The trainer image the KubeRay manifests name (kimi-pipeline:<version>): the CUDA torch (Makefile CUDA_TORCH_SPEC),
# Transformer Engine (the `gpu` extra, built from its sdist against that torch), megatron-core, Ray, Prefect and this
# package, installed by the Makefile's own target; SGLang's environment copied from the SGLang image to where the
# pipeline looks for it (`.venv-sglang` beside the trainer's venv: engine/sglang.py). Build with `make images`,
# which passes every ARG (none has a default here, so nothing can drift from the Makefile).
ARG CUDA_IMAGE
ARG SGLANG_IMAGE
FROM ${SGLANG_IMAGE} AS sglang

FROM ${CUDA_IMAGE}
ARG TORCH_SPEC
RUN test -n "${TORCH_SPEC}" || { echo "TORCH_SPEC is not set: build with make images" >&2; exit 1; }

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 UV_NO_CACHE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git make cmake \
      ninja-build ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kimi-pipeline
COPY . .
# the Makefile's own install (TORCH_SPEC pinned, --build-constraint for the sdist builds), without the SGLang env
RUN make trainer-env PYTHON=python3 TORCH_SPEC="${TORCH_SPEC}" EXTRAS=gpu
COPY --from=sglang /opt/kimi-pipeline/.venv-sglang /opt/kimi-pipeline/.venv-sglang
ENV PATH=/opt/kimi-pipeline/.venv/bin:${PATH} RAY_USAGE_STATS_ENABLED=0
