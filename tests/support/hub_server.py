"""A tiny, real HTTP server speaking the subset of the Hugging Face Hub API that huggingface_hub uses to download.

Covers what `HfApi.repo_info(files_metadata=True)`, `snapshot_download` and `hf_hub_download` need:

- ``GET /api/{models|datasets}/{repo}/revision/{rev}[?blobs=true]``: ``{id, sha, siblings[...]}``; with ``blobs``
  every sibling carries ``size``, ``blobId`` and, for LFS files, ``lfs{sha256, size, pointerSize}``.
- ``GET /api/{models|datasets}/{repo}/tree/{rev}[?recursive=...]``: ``[{type, path, size, oid, lfs{oid, size,
  pointerSize}}]`` (what `snapshot_download` lists).
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` and ``/datasets/{repo}/resolve/...``: ``X-Repo-Commit``, ``ETag``
  (git blob sha1 for regular files, the LFS sha256 for LFS files), ``X-Linked-Etag``/``X-Linked-Size`` for LFS,
  ``Content-Length``, and ``Range: bytes=a-[b]`` (206 + ``Content-Range``).
- Unknown repo: 404 + ``X-Error-Code: RepoNotFound``; unknown revision: 404 + ``RevisionNotFound``; unknown file:
  404 + ``EntryNotFound``.

No Xet headers are ever sent. Every request is recorded (method, path, Authorization header, Range) so tests can
assert on what the client asked for. `corrupt` names files whose served bytes have one byte flipped while the
metadata keeps advertising the true size/sha256 (a hub/CDN serving a bad copy).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class RepoFile:
    data: bytes
    lfs: bool = False

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def git_oid(self) -> str:
        """The git blob id: of the content for regular files, of the LFS pointer for LFS files."""
        return hashlib.sha1(b"blob %d\0" % len(self.pointer) + self.pointer).hexdigest()

    @property
    def pointer(self) -> bytes:
        if not self.lfs:
            return self.data
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n".encode()


@dataclass
class Repo:
    repo_id: str
    repo_type: str  # "model" | "dataset"
    files: dict[str, RepoFile]
    commit: str = ""

    def __post_init__(self):
        if not self.commit:
            self.commit = hashlib.sha1(f"{self.repo_type}:{self.repo_id}".encode()).hexdigest()


@dataclass
class Request:
    method: str
    path: str  # without the query string, percent-decoded
    query: dict[str, list[str]]
    authorization: str | None
    range: str | None


@dataclass
class FakeHub:
    repos: dict[tuple[str, str], Repo] = field(default_factory=dict)  # (repo_type, repo_id) -> Repo
    corrupt: set[str] = field(default_factory=set)  # filenames served with one byte flipped
    requests: list[Request] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ------------------------------------------------------------ content
    def add_repo(self, repo: Repo) -> Repo:
        self.repos[(repo.repo_type, repo.repo_id)] = repo
        return repo

    def served_bytes(self, name: str, f: RepoFile) -> bytes:
        if name not in self.corrupt:
            return f.data
        data = bytearray(f.data)
        data[-1] ^= 0x01  # last byte: the tensor data, so the safetensors header stays valid
        return bytes(data)

    # ------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        assert self._server is not None, "server not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_HubHandler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hf-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None

    # ------------------------------------------------------------ queries for tests
    def record(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    def gets(self, filename: str) -> list[Request]:
        """GET /resolve requests for a file (any repo)."""
        return [
            r for r in self.requests if r.method == "GET" and "/resolve/" in r.path and r.path.endswith("/" + filename)
        ]


_API_RE = re.compile(
    r"^/api/(models|datasets)/(?P<repo>[^/]+/[^/]+)/(?P<what>revision|tree)/(?P<rev>[^/]+)(?P<rest>/.*)?$"
)
_RESOLVE_RE = re.compile(r"^/(?P<prefix>datasets/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


class _HubHandler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # keep pytest output clean
        pass

    # ------------------------------------------------------------ helpers
    def _send(
        self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False
    ) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", (headers or {}).get("Content-Length", str(len(body))))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict[str, str] | None = None, head: bool = False) -> None:
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})}, head)

    def _error(self, code: str, msg: str, head: bool = False, commit: str | None = None) -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": msg}
        if commit:
            headers["X-Repo-Commit"] = commit
        self._json(404, {"error": msg}, headers, head)

    def _repo(self, repo_type: str, repo_id: str, rev: str, head: bool = False) -> Repo | None:
        repo = self.fake.repos.get((repo_type, repo_id))
        if repo is None:
            self._error("RepoNotFound", "Repository not found", head)
            return None
        if rev not in ("main", repo.commit):
            self._error("RevisionNotFound", "Invalid rev id: " + rev, head)
            return None
        return repo

    # ------------------------------------------------------------ verbs
    def do_HEAD(self):
        self._handle(head=True)

    def do_GET(self):
        self._handle(head=False)

    def _handle(self, head: bool) -> None:
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        self.fake.record(
            Request(
                self.command, path, parse_qs(parts.query), self.headers.get("Authorization"), self.headers.get("Range")
            )
        )
        if m := _API_RE.match(path):
            repo_type = "model" if m.group(1) == "models" else "dataset"
            repo = self._repo(repo_type, m["repo"], m["rev"], head)
            if repo is None:
                return
            if m["what"] == "revision" and not m["rest"]:
                return self._json(200, self._info(repo, blobs="blobs" in parse_qs(parts.query)), head=head)
            if m["what"] == "tree":
                return self._json(200, self._tree(repo, (m["rest"] or "").strip("/")), head=head)
        elif m := _RESOLVE_RE.match(path):
            repo = self._repo("dataset" if m["prefix"] else "model", m["repo"], m["rev"], head)
            if repo is None:
                return
            return self._resolve(repo, m["file"], head)
        self._json(404, {"error": f"fake hub: no route for {path}"}, head=head)

    # ------------------------------------------------------------ endpoints
    @staticmethod
    def _info(repo: Repo, blobs: bool) -> dict:
        siblings = []
        for name, f in sorted(repo.files.items()):
            s: dict = {"rfilename": name}
            if blobs:
                s.update(size=len(f.data), blobId=f.git_oid)
                if f.lfs:
                    s["lfs"] = {"sha256": f.sha256, "size": len(f.data), "pointerSize": len(f.pointer)}
            siblings.append(s)
        return {"id": repo.repo_id, "_id": repo.commit[:24], "sha": repo.commit, "private": False, "siblings": siblings}

    @staticmethod
    def _tree(repo: Repo, under: str) -> list[dict]:
        out = []
        for name, f in sorted(repo.files.items()):
            if under and not name.startswith(under + "/"):
                continue
            e: dict = {"type": "file", "path": name, "size": len(f.data), "oid": f.git_oid}
            if f.lfs:
                e["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": len(f.pointer)}
            out.append(e)
        return out

    def _resolve(self, repo: Repo, name: str, head: bool) -> None:
        f = repo.files.get(name)
        if f is None:
            return self._error("EntryNotFound", f"{name} does not exist on this revision", head, commit=repo.commit)
        body = self.fake.served_bytes(name, f)
        headers = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if f.lfs:
            etag = f'"{f.sha256}"'
            headers.update({"ETag": etag, "X-Linked-Etag": etag, "X-Linked-Size": str(len(f.data))})
        else:
            headers["ETag"] = f'"{f.git_oid}"'
        status = 200
        rng = self.headers.get("Range")
        if rng and not head and (rm := re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())):
            start = int(rm[1])
            end = int(rm[2]) if rm[2] else len(body) - 1
            if start >= len(body):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(body)}"})
            end = min(end, len(body) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(body)}"
            body = body[start : end + 1]
            status = 206
        self._send(status, body, headers, head)
