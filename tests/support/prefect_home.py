"""Fresh Prefect homes whose database is already at the installed Prefect's schema.

A Prefect server on an empty home runs every database migration first: 12 CPU-s of a server's 26 on this 2-core
box (measured 2026-11-28: a one-task flow on a fresh home, 26.0 CPU-s with its ephemeral server; with a copied
migrated database, 13.9). Tests that start a server on a home of their own (served deployments, the kill tests'
`kimi run`s, the infra scripts) copy one migrated database instead, made once per test session under a lock (the
two xdist workers share it), and so do the tests that run flows in-process under Prefect's test harness
(`migrated_test_harness`). Each home is still the test's own: a copy, written only by the server it starts.
`kimi run` on an empty home (what a new user runs) stays proven by the learning test, which starts from nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from filelock import FileLock

TEMPLATE_VAR = "KIMI_TEST_PREFECT_TEMPLATE"  # the session's template directory (set by tests/conftest.py)
DB_NAME = "prefect.db"  # Prefect's default database in PREFECT_HOME (PREFECT_API_DATABASE_CONNECTION_URL unset)


def template_dir() -> Path:
    """The session's template directory: named by the environment the controller exported, else this process's."""
    if not os.environ.get(TEMPLATE_VAR):
        os.environ[TEMPLATE_VAR] = tempfile.mkdtemp(prefix="kimi-test-prefect-db-")
    return Path(os.environ[TEMPLATE_VAR])


def _migrated_database() -> Path:
    root = template_dir()
    db = root / DB_NAME
    with FileLock(str(root / ".lock")):
        if not db.is_file():
            staging = root / "staging"
            shutil.rmtree(staging, ignore_errors=True)
            env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL",
                                                                     "PREFECT_API_DATABASE_CONNECTION_URL")}
            done = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                                  env={**env, "PREFECT_HOME": str(staging)}, capture_output=True, text=True,
                                  timeout=600)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            # everything in the one file (SQLite's write-ahead log may hold the last pages beside it)
            with contextlib.closing(sqlite3.connect(staging / DB_NAME)) as c:
                c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            os.replace(staging / DB_NAME, db)
            shutil.rmtree(staging, ignore_errors=True)
    return db


def migrated_home(home: Path) -> Path:
    """`home` (created) holding its own copy of a migrated Prefect database; returns it."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / DB_NAME).exists():
        tmp = home / f".{DB_NAME}.tmp"
        shutil.copyfile(_migrated_database(), tmp)
        os.replace(tmp, home / DB_NAME)
    return home


HARNESS_DB_NAME = "prefect-test.db"  # the database prefect_test_harness makes in its own temporary directory


@contextlib.contextmanager
def migrated_test_harness(server_startup_timeout: int = 120) -> Iterator[None]:
    """Prefect's `prefect_test_harness`, its temporary database a copy of the session's migrated one: its server
    skips the migrations. The harness names its database `prefect-test.db` in a directory from `mkdtemp()`
    (prefect/testing/utilities.py:147,158); that directory is made here with the copy already in it."""
    # imported here, not at the top: tests/conftest.py imports this module before it sets Prefect's environment
    # (Prefect reads it at import), and the GPU image has no Prefect
    import prefect.testing.utilities as prefect_testing

    def temporary_dir_with_database() -> str:
        made = tempfile.mkdtemp()
        shutil.copyfile(_migrated_database(), Path(made) / HARNESS_DB_NAME)
        return made

    with mock.patch.object(prefect_testing, "mkdtemp", temporary_dir_with_database):
        with prefect_testing.prefect_test_harness(server_startup_timeout=server_startup_timeout):
            yield


def remove_template() -> None:
    """The controller removes the session's template at the end."""
    if os.environ.get(TEMPLATE_VAR):
        shutil.rmtree(os.environ[TEMPLATE_VAR], ignore_errors=True)
