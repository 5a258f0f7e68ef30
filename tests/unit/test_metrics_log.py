"""metrics.jsonl after a kill mid-write (issue 40 item 2): a torn line costs that line, never the rows after it,
and a truncation leaves a file the next row appends to cleanly."""

from __future__ import annotations

import logging

from kimi_pipeline.report.metrics import MetricsLog, read_jsonl


def test_a_torn_line_is_dropped_with_a_warning_and_the_rows_after_it_stay(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    # step 2's row torn by a kill; the retry's step-2 row appended to the fragment, then step 3's on a line of its own
    path.write_text('{"step": 1}\n{"step": 2, "lo{"step": 2, "loss": 0.5}\n{"step": 3}\n')
    with caplog.at_level(logging.WARNING, logger="kimi_pipeline.report.metrics"):
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
