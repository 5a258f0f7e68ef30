"""The cluster's container images (infra/docker, `make images`) cannot drift from what `make install` installs.

No docker here: the checks read what `make -n images` would run (the Makefile's own variables, expanded by make) and
the Dockerfiles it builds. The CUDA base's major against the CUDA torch's wheels is checked where pip resolves them
(tests/integration/test_gpu_install_resolves.py).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import yaml

from kimi_pipeline.cluster.kuberay import MANIFEST_DIR, default_image
from support.common import makefile_var

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "infra" / "docker"


def _builds() -> list[dict]:
    """Each `docker build` of `make -n images`: its Dockerfile, build args and tag."""
    out = subprocess.run(["make", "-n", "images"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    builds = []
    for line in out.replace("\\\n", " ").splitlines():
        words = shlex.split(line)
        if words[:2] != ["docker", "build"]:
            continue
        args = dict(a.split("=", 1) for a in (words[i + 1] for i, w in enumerate(words) if w == "--build-arg"))
        builds.append({"file": words[words.index("-f") + 1], "args": args, "tag": words[words.index("-t") + 1],
                       "context": words[-1]})
    return builds


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / dockerfile).read_text())
    lines = [raw.strip() for raw in text.splitlines()]
    return [(w[0].upper(), w[1] if len(w) > 1 else "") for w in (line.split(None, 1) for line in lines
                                                                     if line and not line.startswith("#"))]


def test_make_images_builds_sglang_then_the_trainer_from_the_makefiles_pins():
    sglang, trainer = _builds()
    assert sglang["file"] == "infra/docker/sglang.Dockerfile" and trainer["file"] == "infra/docker/trainer.Dockerfile"
    assert sglang["context"] == trainer["context"] == "."
    want_sglang = (ROOT / "requirements-sglang.txt").read_text().strip().replace("sglang==", "kimi-sglang:")
    assert sglang["tag"] == want_sglang == trainer["args"]["SGLANG_IMAGE"]
    assert trainer["tag"] == default_image()  # the image every KubeRay manifest names
    assert trainer["args"]["TORCH_SPEC"] == makefile_var("CUDA_TORCH_SPEC") and "+cpu" not in trainer["args"]["TORCH_SPEC"]
    assert sglang["args"]["CUDA_IMAGE"] == trainer["args"]["CUDA_IMAGE"]  # SGLang's venv runs unchanged in both
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+(\.\d+)?-cudnn-devel-ubuntu\d+\.\d+", trainer["args"]["CUDA_IMAGE"])


def test_the_dockerfiles_install_only_through_the_makefile():
    """One source of truth: the images run the Makefile's install targets, take every version as a build arg that
    only `make images` passes (no defaults to go stale), and install nothing by hand."""
    for name, target in (("sglang.Dockerfile", "make sglang-env"), ("trainer.Dockerfile", "make trainer-env")):
        steps = _instructions(f"infra/docker/{name}")
        runs = [a for i, a in steps if i == "RUN"]
        assert not [r for r in runs if re.search(r"\bpip3?\b|\buv\b|conda", r)], runs
        assert [r for r in runs if r.startswith(target)], (name, runs)
        args = [a for i, a in steps if i == "ARG"]
        assert args and not [a for a in args if "=" in a], args  # no default values
        assert next(i for i, _ in steps if i != "ARG") == "FROM"
    trainer = _instructions("infra/docker/trainer.Dockerfile")
    (install,) = [a for i, a in trainer if i == "RUN" and a.startswith("make trainer-env")]
    assert 'TORCH_SPEC="${TORCH_SPEC}"' in install and "EXTRAS=gpu" in install
    # SGLang's venv lands where the pipeline looks for it: `.venv-sglang` beside the trainer's venv
    assert ("WORKDIR", "/opt/kimi-pipeline") in trainer
    assert ("COPY", "--from=sglang /opt/kimi-pipeline/.venv-sglang /opt/kimi-pipeline/.venv-sglang") in trainer
    assert ("WORKDIR", "/opt/kimi-pipeline") in _instructions("infra/docker/sglang.Dockerfile")
    assert any(i == "ENV" and a.startswith("PATH=/opt/kimi-pipeline/.venv/bin:") for i, a in trainer)
    # the make targets the images run exist and are what `make install` runs
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^trainer-env: \$\(BIN\)/\.installed$", makefile, re.M)
    assert re.search(r"^install: \$\(BIN\)/\.installed .*sglang-env", makefile, re.M)


def test_the_build_context_leaves_local_environments_out():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".venv-sglang", ".cache", "runs", ".git"} <= ignored


def test_every_kuberay_manifest_names_the_trainer_image():
    manifests = sorted(MANIFEST_DIR.glob("*.yaml"))
    assert manifests
    for path in manifests:
        doc = yaml.safe_load(path.read_text())
        pods = [doc["spec"]["headGroupSpec"]] + doc["spec"]["workerGroupSpecs"]
        images = {c["image"] for p in pods for c in p["template"]["spec"]["containers"]}
        assert images == {default_image()}, (path.name, images)
        assert "`make images`" in path.read_text().split("apiVersion")[0], path.name
