"""One run per run directory (issue 40 item 1): a second run on a held directory fails at once naming the holder,
a dead holder's lock is taken over, default directories are never shared."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kimi_pipeline.util import run_lock
from kimi_pipeline.util.paths import new_run_dir

HOLDER = """
import sys, time
from kimi_pipeline.util import run_lock
run_lock.take(sys.argv[1], sys.argv[2])
print("held", flush=True)
time.sleep(600)
"""


def _hold(run_dir: Path, owner: str) -> subprocess.Popen:
    """Another process holding `run_dir` (as a flow run `owner` would), started and confirmed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), owner], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held", "the holder process did not take the lock"
    return proc


def _stop(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    proc.send_signal(sig)
    proc.wait(timeout=30)


def test_a_held_run_dir_refuses_a_second_run_naming_the_holder_and_a_dead_holders_lock_is_taken_over(tmp_path,
                                                                                                     caplog):
    run_dir = tmp_path / "run"
    proc = _hold(run_dir, "flow-run-1234")
    try:
        with pytest.raises(run_lock.RunDirBusy) as busy:
            run_lock.take(run_dir, "flow-run-5678")
        text = str(busy.value)
        assert str(run_dir.resolve()) in text
        assert f"pid {proc.pid}" in text and f"host {socket.gethostname()}" in text and "flow run flow-run-1234" in text
        assert "--run-dir" in text, "the error names the fix"
        assert run_lock.held_elsewhere(run_dir)
    finally:
        _stop(proc)  # kill -9: no clean let-go; the kernel drops the lock with the process
    assert not run_lock.held_elsewhere(run_dir)
    with caplog.at_level(logging.WARNING, logger=run_lock.__name__):
        run_lock.take(run_dir, "flow-run-5678")
    try:
        assert f"pid {proc.pid}" in caplog.text and "taking it over" in caplog.text
    finally:
        run_lock.release(run_dir)
    assert (run_dir / run_lock.LOCK_FILE).read_text() == "", "a clean let-go clears the holder"


def test_a_flow_runs_retries_reenter_the_lock_and_its_final_hook_lets_go(tmp_path):
    run_dir = tmp_path / "run"
    run_lock.take(run_dir, "flow-run-a")
    run_lock.take(run_dir, "flow-run-a")  # Prefect's retry of the same flow run, in the same process
    with pytest.raises(run_lock.RunDirBusy, match="flow run flow-run-a"):
        run_lock.take(run_dir, "flow-run-b")  # another flow run in this process is another run
    run_lock.release(run_dir)
    probe = _hold_attempt(run_dir)
    assert probe.returncode == 1 and "is in use by another run" in probe.stderr, "one of two holds let go: still held"
    run_lock.release_owner("flow-run-a")
    assert _hold_attempt(run_dir).returncode == 0, "the final-state hook let go of every hold"


def _hold_attempt(run_dir: Path) -> subprocess.CompletedProcess:
    code = ("import sys\nfrom kimi_pipeline.util import run_lock\n"
            "try:\n    run_lock.take(sys.argv[1])\nexcept run_lock.RunDirBusy as e:\n"
            "    print(e, file=sys.stderr); sys.exit(1)\n")
    return subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, timeout=60)


def test_a_stage_command_on_a_held_run_dir_fails_at_once_naming_the_holder(tmp_path):
    from kimi_pipeline.cli import app

    run_dir = tmp_path / "run"
    proc = _hold(run_dir, "flow-run-9")
    try:
        out = CliRunner().invoke(app, ["download", "--run-dir", str(run_dir)])
    finally:
        _stop(proc, signal.SIGTERM)
    assert out.exit_code == 1, out.output
    assert f"pid {proc.pid}" in out.output and "flow run flow-run-9" in out.output
    assert "Traceback" not in out.output
    assert not (run_dir / "recipe.yaml").exists() and not (run_dir / "summary.json").exists(), \
        "nothing written into another run's directory"


def test_two_default_run_dirs_of_one_recipe_in_the_same_second_are_two(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20261127-050000")
    first, second = new_run_dir(tmp_path, "tiny"), new_run_dir(tmp_path, "tiny")
    assert first != second and first.is_dir() and second.is_dir()
    assert [first.name, second.name] == ["20261127-050000-tiny", "20261127-050000-tiny-2"]


def test_the_failure_hook_never_writes_into_a_run_dir_another_run_holds(tmp_path):
    from types import SimpleNamespace

    from flows.notify import _run_dir

    run_dir = tmp_path / "run"
    proc = _hold(run_dir, "flow-run-other")
    try:
        refused = SimpleNamespace(id="flow-run-refused", parameters={"run_dir": str(run_dir)})
        assert _run_dir(refused) is None
    finally:
        _stop(proc)
    assert _run_dir(refused) == run_dir
    assert os.listdir(run_dir) == [run_lock.LOCK_FILE]
