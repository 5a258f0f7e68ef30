"""`DIR/summary.json`: the run's contract with automation, updated as each stage finishes.

Shape: {"recipe": NAME, "stages": {"download": {"status": ..., "seconds": ...}, ...}, "<stage>": {...}}.
Stage status is one of completed | failed | skipped (and running while it runs). Section names are
stable: automation reads them. Every write is redacted (`util.redact`): a stage's error or a section can quote
a secret (a hub URL with its token, an env dump), and summary.json is read by people and automation alike.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kimi_pipeline.util.files import atomic_write_text
from kimi_pipeline.util.redact import redact

STATUSES = ("running", "completed", "failed", "skipped")


def error_line(e: BaseException) -> str:
    """A failed stage's `error` in summary.json: the first six lines of its message joined on one line, at most 1000
    characters (a traceback-long message would bury the status); its type when the message is empty."""
    return " | ".join(line.strip() for line in str(e).strip().splitlines()[:6])[:1000] or type(e).__name__


class RunSummary:
    def __init__(self, run_dir: Path, recipe_name: str | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "summary.json"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if recipe_name is not None:
            self._mutate(lambda d: d.__setitem__("recipe", recipe_name))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.run_dir / ".summary.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def read(self) -> dict[str, Any]:
        if not self.path.is_file():
            return {"recipe": None, "stages": {}}
        return json.loads(self.path.read_text())

    def _mutate(self, fn) -> dict[str, Any]:
        with self._locked():
            data = self.read()
            data.setdefault("stages", {})
            fn(data)
            atomic_write_text(self.path, redact(json.dumps(data, indent=2, default=str) + "\n"))
            return data

    def set_section(self, name: str, payload: dict[str, Any]) -> None:
        if name in ("recipe", "stages"):
            raise ValueError(f"{name!r} is reserved in summary.json")
        self._mutate(lambda d: d.__setitem__(name, payload))

    def upsert_row(self, name: str, row: dict[str, Any], key: str = "step", keep_through: Any = None) -> None:
        """Insert or replace (by `key`) a row of the list section `name`, kept sorted by `key`;
        rows with key > keep_through are dropped first (work after a checkpoint a run resumed from)."""

        def fn(d: dict[str, Any]) -> None:
            rows = [r for r in d.get(name) or [] if r.get(key) != row.get(key)]
            if keep_through is not None:
                rows = [r for r in rows if r.get(key) is not None and r[key] <= keep_through]
            d[name] = sorted(rows + [row], key=lambda r: r.get(key))

        self._mutate(fn)

    def set_stage(self, stage: str, status: str, seconds: float | None = None, **extra: Any) -> None:
        if status not in STATUSES:
            raise ValueError(f"unknown stage status {status!r}")
        entry: dict[str, Any] = {"status": status, "seconds": round(seconds, 3) if seconds is not None else None}
        entry.update(extra)
        self._mutate(lambda d: d["stages"].__setitem__(stage, entry))
