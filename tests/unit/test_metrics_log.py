"""metrics.jsonl after a kill mid-write (issue 40 item 2): a torn line costs that line, never the rows after it,
and a truncation leaves a file the next row appends to cleanly. A W&B outage (item 5) warns and training goes on."""

from __future__ import annotations

import logging
import sys
import types

from kimi_pipeline.report.metrics_log import MetricsLog, open_wandb, read_jsonl


def test_a_torn_line_is_dropped_with_a_warning_and_the_rows_after_it_stay(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    # step 2's row torn by a kill; the retry's step-2 row appended to the fragment, then step 3's on a line of its own
    path.write_text('{"step": 1}\n{"step": 2, "lo{"step": 2, "loss": 0.5}\n{"step": 3}\n')
    with caplog.at_level(logging.WARNING, logger="kimi_pipeline.report.metrics_log"):
        rows = read_jsonl(path)
    assert rows == [{"step": 1}, {"step": 3}]
    assert f"{path}:2: not a JSON row" in caplog.text


def test_truncating_drops_torn_lines_so_the_next_row_reads_back(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    log = MetricsLog(path)
    log.truncate_after(2)
    log.log({"step": 3, "reward_mean": 0.5})
    log.close()
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}, {"step": 3, "reward_mean": 0.5}]
    log = MetricsLog(path)
    log.truncate_after(0)  # a fresh start: no earlier attempt's row stays
    log.close()
    assert path.read_text() == "" and read_jsonl(path) == []


# --------------------------------------------------------------------------- a W&B outage (issue 40 item 5)

KEY = "wandbKeyDuringOutage-0c4e1f"


class DownWandbRun:
    """A W&B run whose service is gone (the network, W&B's backend process): every call raises, as wandb's do."""

    def __init__(self):
        self.calls = 0

    def log(self, scalars, step):
        self.calls += 1
        raise ConnectionError(f"wandb backend unreachable (api_key={KEY})")

    def finish(self):
        raise TimeoutError("W&B did not confirm the run's upload")


def test_a_wandb_outage_warns_once_per_kind_and_the_rows_are_still_written(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    run = DownWandbRun()
    log = MetricsLog(tmp_path / "metrics.jsonl", wandb_run=run)
    with caplog.at_level(logging.WARNING, logger="kimi_pipeline.report.metrics_log"):
        for step in (1, 2, 3):
            log.log({"step": step, "reward_mean": 0.1 * step})
        log.close()
    assert run.calls == 3  # every row is still offered to W&B: it may come back
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # one for log (ConnectionError), one for finish (TimeoutError)
    assert "W&B log failed (ConnectionError: wandb backend unreachable (api_key=<WANDB_API_KEY>))" in warnings[0]
    assert "training goes on" in warnings[0] and "W&B finish failed (TimeoutError" in warnings[1]
    assert KEY not in caplog.text


def test_wandb_init_failing_leaves_training_without_the_mirror(tmp_path, caplog, monkeypatch):
    """A stand-in `wandb` module (W&B is a network service: its outage is what is simulated) whose init raises as
    wandb's does when W&B cannot be reached."""
    monkeypatch.setenv("WANDB_API_KEY", KEY)

    def init(**kwargs):
        raise RuntimeError(f"Run initialization has timed out after 90.0 sec; key {KEY}")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with caplog.at_level(logging.WARNING, logger="kimi_pipeline.report.metrics_log"):
        run = open_wandb(None, "tiny-outage", {})
    assert run is None
    assert "W&B unavailable (RuntimeError: Run initialization has timed out" in caplog.text
    assert "training goes on" in caplog.text and KEY not in caplog.text and "<WANDB_API_KEY>" in caplog.text
    log = MetricsLog(tmp_path / "metrics.jsonl", wandb_run=run)
    log.log({"step": 1, "reward_mean": 0.5})
    log.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "reward_mean": 0.5}]
