"""The GPU install set resolves, checked on CPU by pip's own resolver (`pip install --dry-run --report`).

Why: the `gpu` extra could not be installed at all while it held `sglang[srt]`: sglang pins transformers==5.19.0 and
compressed-tensors==0.18.0, this project needs transformers>=5.23 and compressed-tensors>=0.20, and nothing on a CPU
machine noticed. SGLang now runs from its own interpreter (`sglang.python`, `make sglang-env`), so a GPU machine
has two environments, and this test resolves both, the way `make install TORCH_SPEC=torch==2.14.1 EXTRAS=dev,gpu`
installs them:

- the trainer: `pip install -e ".[dev,gpu]" torch==2.14.1` (the `gpu` extra is `transformer-engine[pytorch]`);
- SGLang's own: `pip install -r requirements-sglang.txt` (sglang pins its own transformers / compressed-tensors /
  torch).

It asserts that each resolves with the pins it must have, and that the two could not be one environment (the
trainer's requirements exclude the versions sglang pins).

Metadata only, no CUDA wheel: pip reads each wheel's metadata from the index's PEP 658 `.metadata` file where the
index serves one (the public index does), and with `--use-feature=fast-deps` from HTTP range requests (the zip's
directory and METADATA, a few kB) where it does not (some mirrors); `--dry-run` never fetches the wheels
themselves. The one exception is `transformer_engine_torch`, an sdist only: pip would build its metadata in an
isolated build environment holding a CUDA torch (multi-GB, its setup.py picks `transformer_engine_cu12`/`_cu13`
from `torch.version.cuda`). Instead a metadata-only wheel is made from the sdist's own PKG-INFO (half a MB) and
offered through `--find-links` (`--only-binary` for that one package, so a build can never start), and the test
checks that its `transformer_engine_cuNN` pin matches the CUDA major of the torch the trainer resolves, which is
what the real build would write. The test asserts that no distribution over 50 MB is downloaded whole.

Needs network access to the package index; without it the test fails, saying so (it does not skip).
"""

from __future__ import annotations

import email.parser
import functools
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from support.common import makefile_var

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _index() -> str:
    """The index pip itself uses: $PIP_INDEX_URL, else pip's configured index-url, else pip's own default."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"].rstrip("/")
    done = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                          text=True)
    if done.returncode == 0 and done.stdout.strip():
        return done.stdout.strip().rstrip("/")
    # pip's default index (the module pip's own options read), asked of a child: importing pip's internals here takes
    # setuptools' distutils shim out of this process (pip/_internal/locations/_distutils.py: remove_shim), and a
    # later test's `import megatron` → `import setuptools` then fails on the standard library's distutils
    default = subprocess.run([sys.executable, "-c", "from pip._internal.models.index import PyPI; "
                              "print(PyPI.simple_url)"], capture_output=True, text=True, check=True)
    return default.stdout.strip().rstrip("/")
TE_TORCH = "transformer_engine_torch"
MAX_WHOLE_DOWNLOAD_MB = 50  # fast-deps may still fetch small files whole; nothing CUDA-sized

pytestmark = pytest.mark.slow  # two resolutions of ~200 packages each, at once: ~100 s on 2 cores


def _gpu_torch_spec() -> str:
    """The GPU torch the Makefile pins (`CUDA_TORCH_SPEC := torch==X`: GPU installs and the trainer image)."""
    spec = makefile_var("CUDA_TORCH_SPEC")
    assert re.fullmatch(r"torch==[\w.+]+", spec), f"Makefile CUDA_TORCH_SPEC is {spec!r}, not torch==X"
    return spec


def _cuda_image_major() -> int:
    """The CUDA major of the images' base (Makefile `CUDA_IMAGE ?= nvidia/cuda:X.Y...`, `make images`)."""
    m = re.fullmatch(r"nvidia/cuda:(\d+)\..*", makefile_var("CUDA_IMAGE"))
    assert m, "Makefile no longer names the images' base as `CUDA_IMAGE ?= nvidia/cuda:X.Y...`"
    return int(m.group(1))


def _pip_flags() -> list[str]:
    """What the Makefile passes (PIP_FLAGS), plus pip's fast-deps for indexes without PEP 658 metadata files."""
    flags = ["--disable-pip-version-check", "--progress-bar", "off", "--use-feature=fast-deps"]
    return flags + (["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else [])


def _get(url: str, accept: str = "*/*") -> tuple[bytes, str]:
    req = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "kimi-pipeline-tests"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.read(), resp.headers.get("Content-Type", "")
    except OSError as e:  # URLError, timeouts, resets
        error = e
    pytest.fail(f"this test needs network access to the package index ({_index()}): GET {url} failed: {error!r}",
                pytrace=False)


def _sdist_pkg_info(project: str, version: str) -> str:
    """PKG-INFO of `project==version`'s sdist on the index (PEP 691 JSON, or the HTML simple page)."""
    body, ctype = _get(f"{_index()}/{canonicalize_name(project)}/",
                       accept="application/vnd.pypi.simple.v1+json, text/html;q=0.1")
    if "json" in ctype:
        files = [(f["filename"], f["url"], f.get("hashes", {}).get("sha256")) for f in json.loads(body)["files"]]
    else:
        files = [(Path(href.split("#")[0]).name, href.split("#")[0], (re.findall(r"sha256=(\w+)", href) or [None])[0])
                 for href in re.findall(r'href="([^"]+)"', body.decode())]
    wanted = {f"{n}-{version}.tar.gz".lower() for n in (project, project.replace("_", "-"))}
    sdists = [f for f in files if f[0].lower() in wanted]
    assert sdists, f"no sdist of {project}=={version} on {_index()}: files seen: {[f[0] for f in files][-10:]}"
    name, url, sha256 = sdists[0]
    data, _ = _get(urllib.request.urljoin(f"{_index()}/{canonicalize_name(project)}/", url))
    assert sha256 is None or hashlib.sha256(data).hexdigest() == sha256, f"{name}: sha256 differs from the index's"
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = next(m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"))
        return tar.extractfile(member).read().decode()


def _metadata_only_wheel(pkg_info: str, dest: Path) -> Path:
    """A wheel holding only METADATA (the sdist's PKG-INFO, less the sdist-only fields): enough for a resolver."""
    msg = email.parser.Parser().parsestr(pkg_info)
    keep = ("Name", "Version", "Requires-Python", "Requires-Dist", "Provides-Extra")
    lines = ["Metadata-Version: 2.1"] + [f"{k}: {v}" for k, v in msg.items() if k in keep]
    name, version = msg["Name"], msg["Version"]
    info = f"{name}-{version}.dist-info"
    wheel = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{info}/METADATA", "\n".join(lines) + "\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: kimi-pipeline-tests\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


@dataclass
class _Resolution:
    """One `pip install --dry-run` running in the background, its output in files (two pips writing to pipes read
    one after the other could fill a pipe and stall)."""

    cmd: list[str]
    proc: subprocess.Popen
    report: Path
    out: Path
    started: float


def _start(args: list[str], report: Path) -> _Resolution:
    """`pip install --dry-run --ignore-installed --report` in this interpreter, started: installs nothing into this
    environment (pip's isolated build environments are temporary)."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--report", str(report),
           *_pip_flags(), *args]
    env = {**os.environ, "PIP_NO_INPUT": "1"}
    out = report.with_suffix(".log")
    with out.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return _Resolution(cmd, proc, report, out, time.monotonic())


def _finish(r: _Resolution) -> tuple[dict, float, str]:
    """Wait for a resolution: (report, seconds, pip's output)."""
    try:
        r.proc.wait(timeout=540)
    except subprocess.TimeoutExpired:
        r.proc.kill()
        r.proc.wait()
    seconds = time.monotonic() - r.started
    output = f"$ {' '.join(r.cmd)}\n--- output ---\n{r.out.read_text()}"
    tail = output[-20000:]
    if r.proc.returncode != 0:
        offline = re.search(r"NewConnectionError|NameResolutionError|Network is unreachable|Max retries exceeded",
                            output)
        pytest.fail(("pip could not reach the package index: this test needs network access.\n" if offline else "")
                    + f"pip exited {r.proc.returncode} after {seconds:.0f} s:\n{tail}", pytrace=False)
    whole = [(m[1], float(m[2]) * {"kB": 1e-3, "MB": 1, "GB": 1e3}[m[3]])
             for m in re.finditer(r"Downloading (\S+) \(([\d.]+) (kB|MB|GB)\)", output)]
    big = [f"{n} ({mb:.0f} MB)" for n, mb in whole if mb > MAX_WHOLE_DOWNLOAD_MB]
    assert not big, f"the dry run downloaded whole distributions, not only metadata: {big}\n{tail}"
    print(f"resolved in {seconds:.1f} s; {len(whole)} small files fetched whole "
          f"({sum(mb for _, mb in whole):.1f} MB)")
    return json.loads(r.report.read_text()), seconds, tail


def _versions(report: dict) -> dict[str, str]:
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}


def _requires(report: dict, name: str) -> list[Requirement]:
    item = next(i for i in report["install"] if canonicalize_name(i["metadata"]["name"]) == canonicalize_name(name))
    return [Requirement(r) for r in item["metadata"].get("requires_dist", [])]


def _pin(reqs: list[Requirement], name: str, extra: str = "") -> str:
    """The version `name==X` in a Requires-Dist list (unconditional, or under `extra`), else fail naming what is
    there."""
    for r in reqs:
        if canonicalize_name(r.name) == canonicalize_name(name) and (
                r.marker is None if not extra else r.marker is not None and r.marker.evaluate({"extra": extra})):
            specs = list(r.specifier)
            if len(specs) == 1 and specs[0].operator == "==":
                return specs[0].version
            pytest.fail(f"{name} is not pinned (==) but {r}", pytrace=False)
    pytest.fail(f"no {name} in {[str(r) for r in reqs]}", pytrace=False)


@pytest.fixture(scope="module")
def te_stub(tmp_path_factory) -> Path:
    """A find-links folder with transformer_engine_torch's metadata-only wheel, at the version the `gpu` extra
    pins (transformer-engine[pytorch]==X requires transformer_engine_torch==X)."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"transformer-engine\[pytorch\]==([\w.]+)"', text)
    assert m, "pyproject.toml's gpu extra no longer pins transformer-engine[pytorch]==X"
    dest = tmp_path_factory.mktemp("te-stub")
    _metadata_only_wheel(_sdist_pkg_info(TE_TORCH, m.group(1)), dest)
    return dest


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory, te_stub) -> dict[str, tuple[dict, float]]:
    """Both sets resolved at once: each pip waits mostly on the index, so together they take about as long as the
    slower one alone."""
    started = {
        "trainer": _start(["--find-links", str(te_stub), "--only-binary", TE_TORCH, "-e", ".[dev,gpu]",
                           _gpu_torch_spec()], tmp_path_factory.mktemp("trainer") / "report.json"),
        "sglang": _start(["-r", "requirements-sglang.txt"], tmp_path_factory.mktemp("sglang") / "report.json"),
    }
    try:
        return {name: _finish(r)[:2] for name, r in started.items()}
    finally:
        for r in started.values():  # a failure in one leaves no pip running behind the test
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()


@pytest.fixture(scope="module")
def trainer(resolutions) -> tuple[dict, float]:
    return resolutions["trainer"]


@pytest.fixture(scope="module")
def sglang(resolutions) -> tuple[dict, float]:
    return resolutions["sglang"]


def test_trainer_set_resolves(trainer):
    report, seconds = trainer
    got = _versions(report)
    own = _requires(report, "kimi-pipeline")
    torch = _gpu_torch_spec().split("==")[1]
    te = _pin(own, "transformer-engine", extra="gpu")
    assert got.get("kimi-pipeline") == "0.1.0", sorted(got)
    assert got.get("torch") == torch, f"torch {got.get('torch')}, want {torch} ({seconds:.0f} s)"
    assert got.get("transformer-engine") == te
    assert got.get("transformer-engine-torch") == te
    assert got.get("megatron-core") == _pin(own, "megatron-core")
    for name in ("transformers", "compressed-tensors"):  # the trainer's own ranges, not sglang's pins
        req = next(r for r in own if canonicalize_name(r.name) == name)
        assert req.specifier.contains(got[name]), f"{name} {got[name]} outside {req}"
    # transformer_engine_torch's setup.py pins transformer_engine_cu{torch.version.cuda major}: the stub's pin
    # must be the one a build against the resolved (CUDA) torch would write.
    cuda = set()
    for r in _requires(report, "torch"):
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        if canonicalize_name(r.name) == "cuda-toolkit":
            cuda |= {Version(s.version.rstrip(".*")).major for s in r.specifier if s.operator == "=="}
        elif m := re.fullmatch(r"nvidia-.+-cu(\d+)", canonicalize_name(r.name)):
            cuda.add(int(m[1]))
    assert len(cuda) == 1, f"cannot tell torch {torch}'s CUDA major from its requirements: {cuda}"
    major = cuda.pop()
    # the trainer image builds Transformer Engine against that torch with the base image's nvcc: the same major
    base = _cuda_image_major()
    assert base == major, f"Makefile CUDA_IMAGE is CUDA {base}, torch {torch}'s wheels are CUDA {major}"
    core = f"transformer-engine-cu{major}"
    assert got.get(core) == te, f"want {core}=={te} (torch {torch}'s CUDA), resolved: " \
                                f"{ {k: v for k, v in got.items() if k.startswith('transformer-engine')} }"


def test_sglang_set_resolves_with_its_own_pins(sglang):
    report, seconds = sglang
    got = _versions(report)
    want = (ROOT / "requirements-sglang.txt").read_text().split("==")[1].strip()
    assert got.get("sglang") == want, f"sglang {got.get('sglang')}, want {want} ({seconds:.0f} s)"
    reqs = _requires(report, "sglang")
    for name in ("transformers", "compressed-tensors", "torch"):
        assert got.get(name) == _pin(reqs, name), f"{name} {got.get(name)}, sglang pins {_pin(reqs, name)}"


def test_the_two_sets_cannot_be_one_environment(trainer, sglang):
    """sglang's transformers and compressed-tensors pins lie outside the trainer's requirements: the reason SGLang
    runs from its own interpreter (`sglang.python`)."""
    (t_report, _), (s_report, _) = trainer, sglang
    own, pins = _requires(t_report, "kimi-pipeline"), _requires(s_report, "sglang")
    t_got, s_got = _versions(t_report), _versions(s_report)
    for name in ("transformers", "compressed-tensors"):
        req = next(r for r in own if canonicalize_name(r.name) == name)
        pin = _pin(pins, name)
        assert not req.specifier.contains(Version(pin)), f"sglang's {name}=={pin} now fits the trainer's {req}"
        assert t_got[name] != s_got[name]
