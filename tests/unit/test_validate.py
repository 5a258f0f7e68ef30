"""Stage `validate`: every bad-row kind quarantined with its reason; thresholds; contamination; parquet."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_pipeline.data.validation import DataValidationError, run_validate, validate_split
from kimi_pipeline.model.tokenizer import load_tokenizer
from kimi_pipeline.recipes import load_recipe
from support.common import TINY

GOOD = {"prompt": [{"role": "user", "content": "What is 1+1? Answer in \\boxed{}."}], "label": "2"}
BAD_LINES = {
    "missing label": json.dumps({"prompt": [{"role": "user", "content": "What is 2+2?"}]}),
    "empty prompt": json.dumps({"prompt": "   ", "label": "3"}),
    "invalid role": json.dumps({"prompt": [{"role": "wizard", "content": "hi"}], "label": "3"}),
    "duplicate prompt": json.dumps({"prompt": [{"role": "user", "content": "what is 1+1?  answer in \\boxed{}"}], "label": "2"}),
    "overlong prompt": json.dumps({"prompt": "What is 1+1? " * 40, "label": "2"}),
    "not valid JSON": '{"prompt": "unterminated',
    "not a JSON object": "[1, 2, 3]",
    "empty label": json.dumps({"prompt": "What is 5+0?", "label": " "}),
    "label does not parse as a math answer": json.dumps({"prompt": "What is 6+0?", "label": "}}{{"}),
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY / "model")


def _data(preset: str, sets: list[str] | None = None):
    """The sections the validation reads: the data section and the prompt-length limit."""
    r = load_recipe(preset, sets or [])
    return r.data, r.rollout.max_prompt_len


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_bad_row_kind_is_quarantined(tmp_path, tok):
    lines = [json.dumps(GOOD)] + list(BAD_LINES.values()) + ["", json.dumps({"prompt": "What is 3+3?", "label": "6"})]
    path = write(tmp_path / "rows.jsonl", lines)
    clean, bad, stats = validate_split("train", path, *_data("tiny"), tok)
    by_line = {b["line"]: b for b in bad}
    for i, (kind, _) in enumerate(BAD_LINES.items()):
        entry = by_line[i + 2]
        assert any(kind in r for r in entry["reasons"]), (kind, entry)
        assert entry["file"] == str(path) and entry["raw"]
    assert stats["reasons"] and sum(stats["reasons"].values()) == len(BAD_LINES)
    assert [c["_source_line"] for c in clean] == [1, len(lines)]  # the blank line is skipped, not a row
    assert stats["rows"] == len(BAD_LINES) + 2


def test_threshold_fails_with_report_and_quarantine(tmp_path, tok):
    train = write(tmp_path / "train.jsonl", [json.dumps(GOOD), BAD_LINES["not valid JSON"]])
    evals = write(tmp_path / "eval.jsonl", [json.dumps({"prompt": "What is 4+4?", "label": "8"})])
    with pytest.raises(DataValidationError, match=r"train: 1/2 rows bad .* data.max_bad_fraction") as e:
        run_validate(*_data("tiny"), tmp_path / "run", train, evals, tok)
    assert e.value.section["train"]["bad_rows"] == 1
    q = (tmp_path / "run" / "validate" / "quarantine-train.jsonl").read_text().splitlines()
    assert json.loads(q[0])["line"] == 2
    assert not (tmp_path / "run" / "validate" / "train.jsonl").exists()  # clean files only when passed
    section = run_validate(*_data("tiny", ["data.max_bad_fraction=0.5"]), tmp_path / "run", train, evals, tok)
    assert section["passed"] and section["bad_rows"] == 1


def test_contamination_detected(tmp_path, tok):
    train = write(tmp_path / "train.jsonl", [json.dumps(GOOD), json.dumps({"prompt": "What is 2+5?", "label": "7"})])
    evals = write(tmp_path / "eval.jsonl", ['{"prompt": "what is 1+1? Answer in \\\\boxed{}", "label": "2"}',
                                            json.dumps({"prompt": "What is 9-1?", "label": "8"})])
    with pytest.raises(DataValidationError, match=r"contamination: 1/2 eval prompts"):
        run_validate(*_data("tiny"), tmp_path / "run", train, evals, tok)
    ok = run_validate(*_data("tiny", ["data.max_contamination=0.5"]), tmp_path / "run", train, evals, tok)
    assert ok["contamination"]["overlap"] == 1


def test_contamination_catches_commuted_and_reworded_problems(tmp_path, tok):
    """2+5 in train, 5+2 / "the sum of 5 and 2" in eval: the same problem, not the same text."""
    train = write(tmp_path / "train.jsonl", [json.dumps(GOOD), json.dumps({"prompt": "What is 2+5?", "label": "7"})])
    evals = write(tmp_path / "eval.jsonl", [json.dumps({"prompt": "What is 5+2?", "label": "7"}),
                                            json.dumps({"prompt": "Find the sum of 5 and 2.", "label": "7"}),
                                            json.dumps({"prompt": "What is 5-2?", "label": "3"})])
    with pytest.raises(DataValidationError, match=r"contamination: 2/3 eval prompts .*2 as equivalent problems") as e:
        run_validate(*_data("tiny"), tmp_path / "run", train, evals, tok)
    cont = e.value.section["contamination"]
    assert [x["line"] for x in cont["examples"]] == [1, 2] and cont["examples"][0]["match"].startswith("equivalent")


def test_parquet_loads_through_datasets(tmp_path, tok):
    import pandas as pd

    rows = [GOOD, {"prompt": [{"role": "user", "content": "What is 2+2?"}], "label": "4"}, {"prompt": [], "label": "1"}]
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    clean, bad, stats = validate_split("train", tmp_path / "d.parquet", *_data("tiny"), tok)
    assert len(clean) == 2 and bad[0]["line"] == 3 and "empty prompt" in bad[0]["reasons"][0]


def test_unreadable_file_is_named(tmp_path, tok):
    p = tmp_path / "d.parquet"
    p.write_bytes(b"not parquet at all")
    with pytest.raises(DataValidationError, match=str(p)):
        validate_split("train", p, *_data("tiny"), tok)


def test_shipped_tiny_data_is_clean(tmp_path, tok):
    section = run_validate(*_data("tiny"), tmp_path, TINY / "dapo-math-tiny.jsonl", TINY / "aime-tiny.jsonl", tok)
    assert section["bad_rows"] == 0 and section["contamination"]["overlap"] == 0 and section["passed"]


# ---------------------------------------------------------------------------------------------- hostile rows
# Issue 40 item 3: each of these once escaped validation as a bare exception (retried as if transient) or failed the
# whole file: a label past Python's integer digit limit, one non-UTF-8 byte, a prompt nested 5,000 lists deep, a
# lone surrogate from a JSON escape (the tokenizer cannot encode it).
HOSTILE = {
    "label of 5,000 digits": (b'{"prompt": "What is 1+2?", "label": ' + b"9" * 5000 + b"}", "not valid JSON (Exceeds"),
    "non-UTF-8 byte": (b'{"prompt": "What is 2+\xff?", "label": "3"}', "not valid UTF-8 (byte 0xff at byte 23)"),
    "5,000-deep prompt": (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b', "label": "1"}',
                          "not valid JSON (nested deeper than the JSON reader allows)"),
    "lone surrogate": (b'{"prompt": "What is \\ud800 2+2?", "label": "4"}',
                       "not valid UTF-8 text (lone surrogate \\ud800 from a JSON escape)"),
}
GOODS = [json.dumps({"prompt": f"What is {a} plus {b} times {a + b + 1}?", "label": str(a + b * (a + b + 1))})
         for a, b in ((1, 2), (3, 4), (5, 6), (7, 8), (9, 10))]


def test_hostile_rows_are_quarantined_each_with_its_reason_and_the_good_rows_stay(tmp_path, tok):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join([GOODS[0].encode()] + [line for line, _ in HOSTILE.values()] + [GOODS[1].encode()])
                     + b"\n")
    clean, bad, stats = validate_split("train", path, *_data("tiny"), tok)
    assert [c["_source_line"] for c in clean] == [1, len(HOSTILE) + 2]
    for (kind, (_, reason)), entry in zip(HOSTILE.items(), bad):
        assert entry["file"] == str(path) and entry["fields"] == ["<line>"], kind
        assert entry["reasons"][0].startswith(reason), (kind, entry["reasons"])
    assert [b["line"] for b in bad] == list(range(2, len(HOSTILE) + 2)) and stats["bad_rows"] == len(HOSTILE)


def _json_values():
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                                              inner, max_size=4),
                        max_leaves=12)


def _hostile_lines():
    """Arbitrary bytes, arbitrary JSON objects under the row's keys, and the kept cases, none with a newline."""
    raw = st.binary(max_size=120).map(lambda b: b.replace(b"\n", b" "))
    rows = st.fixed_dictionaries({}, optional={"prompt": _json_values(), "label": _json_values(),
                                               "extra": _json_values()}).map(lambda d: json.dumps(d).encode())
    text = st.text(max_size=60).map(lambda t: t.replace("\n", " ").encode("utf-8", "surrogatepass"))
    return raw | rows | text | st.sampled_from([line for line, _ in HOSTILE.values()])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inserts=st.lists(st.tuples(st.integers(0, len(GOODS)), _hostile_lines()), max_size=8))
def test_any_line_bytes_mixed_into_good_rows_end_clean_or_quarantined(tok, tmp_path_factory, inserts):
    """Property (hypothesis): whatever bytes the lines between good rows hold, validation returns (it raises nothing),
    every non-blank line is either a clean row or a quarantined one with its file, line, field and reason, and the
    good rows stay clean."""
    lines = [g.encode() for g in GOODS]
    for at, line in sorted(inserts, key=lambda x: -x[0]):
        lines.insert(at, line)
    path = tmp_path_factory.mktemp("hostile") / "rows.jsonl"
    content = b"\n".join(lines) + b"\n"
    path.write_bytes(content)
    clean, bad, stats = validate_split("train", path, *_data("tiny"), tok)
    rows = [n for n, line in enumerate(content.split(b"\n"), 1) if line.strip()]
    assert sorted([c["_source_line"] for c in clean] + [b["line"] for b in bad]) == rows
    assert all(b["file"] == str(path) and b["fields"] and b["reasons"] and all(b["reasons"]) for b in bad), bad
    good_lines = [n for n, line in enumerate(content.split(b"\n"), 1) if line.decode("utf-8", "replace") in GOODS]
    assert set(good_lines) <= {c["_source_line"] for c in clean} | {b["line"] for b in bad if any(
        "duplicate prompt" in r for r in b["reasons"])}
    assert stats["rows"] == len(rows) and stats["bad_rows"] == len(bad)
