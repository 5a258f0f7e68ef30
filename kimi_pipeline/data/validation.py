"""Stage `validate`: DAPO/AIME rows through pandera; bad rows quarantined with a reason, never dropped silently.

Parquet loads through `datasets`; JSON lines are read as bytes and each line decoded and parsed on its own (a
non-UTF-8 byte, a number past Python's digit limit or nesting past its JSON reader's depth is one bad row, not a
crash of the file: `datasets`' text loader decodes the whole file at once). Every line ends clean or quarantined,
and validation raises nothing but its own permanent `DataValidationError`. Clean rows are written to
DIR/validate/{train,eval}.jsonl for the later stages; bad rows to DIR/validate/quarantine-{split}.jsonl with the
file, line, field and reason. The stage fails (after writing its report) when a split's bad fraction exceeds
`data.max_bad_fraction` or train/eval contamination exceeds `data.max_contamination`.
"""

from __future__ import annotations

import collections
import gzip
import json
import math
import zlib
from pathlib import Path
from typing import Any

import datasets
import pandas as pd
import pandera.errors as pa_errors

from kimi_pipeline.data.rows import (
    as_messages,
    label_value_problem,
    normalize_problem,
    problem_signature,
    prompt_problem,
)
from kimi_pipeline.data.schemas import row_schema
from kimi_pipeline.errors import SectionError
from kimi_pipeline.recipes.models import DataSpec
from kimi_pipeline.util.files import atomic_write_json, atomic_write_jsonl

RAW_PREVIEW_CHARS = 2000


class DataValidationError(SectionError):
    """Too many bad rows / contamination / unreadable file. `section` carries the report."""


def load_rows(path: Path, cache_dir: Path | None = None) -> list[tuple[int, Any, str | None, str]]:
    """(line, parsed object or None, why the line is not a row or None, raw text) per non-blank line."""

    path = Path(path)
    if not path.is_file():
        raise DataValidationError(f"data file {path} does not exist; run the download stage first")
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    if suffix == ".parquet":
        datasets.disable_progress_bars()
        kw = {"split": "train", "cache_dir": str(cache_dir) if cache_dir else None, "keep_in_memory": True}
        try:
            ds = datasets.load_dataset("parquet", data_files=str(path), **kw)
        except Exception as e:  # a corrupt parquet: name the file, not the arrow internals
            raise DataValidationError(f"{path}: cannot be read as {suffix} ({type(e).__name__}: {str(e)[:200]})") \
                from None
        return [(i + 1, row, None, json.dumps(row, default=str)[:RAW_PREVIEW_CHARS]) for i, row in enumerate(ds)]
    if suffix not in (".jsonl", ".json", ".jsonl.gz", ".json.gz"):
        raise DataValidationError(f"{path}: unsupported data format {suffix!r}; use .jsonl or .parquet")
    out = []
    try:
        with (gzip.open(path, "rb") if suffix.endswith(".gz") else open(path, "rb")) as f:
            for n, raw in enumerate(f, 1):
                if raw.strip():  # blank lines are not rows
                    out.append((n, *_parse_line(raw)))
    except (OSError, EOFError, zlib.error) as e:  # a corrupt gzip, an unreadable file
        raise DataValidationError(f"{path}: cannot be read as {suffix} ({type(e).__name__}: {str(e)[:200]})") from None
    return out


def _parse_line(raw: bytes) -> tuple[Any, str | None, str]:
    """(the row's object or None, why the line is not a row or None, its text for the quarantine) of one line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        text = raw.decode("utf-8", errors="backslashreplace")
        return None, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1})", text[:RAW_PREVIEW_CHARS]
    preview = line[:RAW_PREVIEW_CHARS]
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at column {e.colno})", preview
    except RecursionError:
        return None, "not valid JSON (nested deeper than the JSON reader allows)", preview
    except ValueError as e:  # e.g. an integer past Python's digit limit
        return None, f"not valid JSON ({str(e).split(';')[0]})", preview
    if not isinstance(obj, dict):
        return None, f"not a JSON object (got {type(obj).__name__})", preview
    if (bad := _unencodable(obj)) is not None:
        return None, f"not valid UTF-8 text ({bad})", preview
    return obj, None, preview


def _unencodable(obj: Any) -> str | None:
    """A string in the row that cannot be written as UTF-8 (a lone surrogate from a JSON \\u escape), found without
    recursion (rows may nest as deep as the JSON reader allows)."""
    todo = [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            todo += list(x.keys()) + list(x.values())
        elif isinstance(x, list):
            todo += x
        elif isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                return f"lone surrogate \\u{ord(x[e.start]):04x} from a JSON escape"
    return None


def _render(prompts: list[Any], tokenizer, apply_chat_template: bool) -> list[int]:
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template(as_messages(p), tokenize=False, add_generation_prompt=True)
                 for p in prompts]
    else:
        texts = [p if isinstance(p, str) else "\n".join(m["content"] for m in p) for p in prompts]
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [len(x) for x in enc]


def _prompt_lengths(prompts: list[Any], tokenizer, apply_chat_template: bool) -> list[int | str]:
    """Each prompt's token count with the chat template, or why it cannot be rendered: the whole batch at once, and
    one by one only when the batch fails (so one prompt the template or tokenizer refuses is one bad row)."""
    try:
        return list(_render(prompts, tokenizer, apply_chat_template))
    except Exception:  # noqa: BLE001 - find the rows at fault below
        pass
    out: list[int | str] = []
    for p in prompts:
        try:
            out.append(_render([p], tokenizer, apply_chat_template)[0])
        except Exception as e:  # noqa: BLE001 - a property of this row
            out.append(f"prompt cannot be rendered with the chat template and tokenized ({type(e).__name__}: "
                       f"{str(e)[:200]})")
    return out


def validate_split(
    split: str, path: Path, data: DataSpec, max_prompt_len: int, tokenizer, cache_dir: Path | None = None
) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """(clean rows, quarantined rows, stats) for one data file. Raises DataValidationError only (permanent: what
    a file holds does not change on a retry), naming the file."""
    try:
        return _validate_split(split, path, data, max_prompt_len, tokenizer, cache_dir)
    except DataValidationError:
        raise
    except Exception as e:  # noqa: BLE001 - a row no check foresaw: the file named, never retried as transient
        raise DataValidationError(f"{path}: validation stopped on this file ({type(e).__name__}: {str(e)[:300]}); "
                                  "the rows in it defeat a check: please report it with the file") from e


def _validate_split(
    split: str, path: Path, data: DataSpec, max_prompt_len: int, tokenizer, cache_dir: Path | None
) -> tuple[list[dict], list[dict], dict[str, Any]]:
    ikey, lkey = data.input_key, data.label_key
    path = Path(path)
    rows = load_rows(path, cache_dir)
    frame = []
    for line, obj, err, _raw in rows:
        prompt = obj.get(ikey) if obj is not None else None
        label = obj.get(lkey) if obj is not None else None
        ok_prompt = err is None and prompt_problem(prompt) is None
        frame.append(
            {
                "json_error": err,
                "prompt": prompt,
                "label": label,
                "problem_key": normalize_problem(prompt) if ok_prompt else f"<invalid prompt, line {line}>",
                "prompt_tokens": math.nan,
            }
        )
    cols = ["json_error", "prompt", "label", "problem_key"]
    df = pd.DataFrame({c: pd.Series([r[c] for r in frame], dtype=object) for c in cols})
    df["prompt_tokens"] = pd.Series([math.nan] * len(frame), dtype=float)
    valid_idx = [i for i, r in enumerate(frame) if r["json_error"] is None and prompt_problem(r["prompt"]) is None]
    reasons: dict[int, list[tuple[str, str]]] = collections.defaultdict(list)
    if valid_idx:
        lengths = _prompt_lengths([frame[i]["prompt"] for i in valid_idx], tokenizer, data.apply_chat_template)
        for i, n in zip(valid_idx, lengths):
            if isinstance(n, str):
                reasons[i].append((ikey, n))
            else:
                df.at[i, "prompt_tokens"] = float(n)
    max_tokens = max_prompt_len
    try:
        row_schema(f"{split}:{path.name}", max_tokens).validate(df, lazy=True)
    except pa_errors.SchemaErrors as e:
        first_seen: dict[str, int] = {}
        for i, r in enumerate(frame):
            first_seen.setdefault(r["problem_key"], rows[i][0])
        for fc in e.failure_cases.itertuples():
            if fc.index is None or (isinstance(fc.index, float) and math.isnan(fc.index)):
                raise DataValidationError(f"{path}: schema error in column {fc.column}: {fc.check}") from None
            i = int(fc.index)
            r = frame[i]
            if fc.column == "json_error":
                reasons[i].append(("<line>", r["json_error"]))
            elif fc.column == "prompt":
                reasons[i].append((ikey, prompt_problem(r["prompt"]) or "invalid prompt"))
            elif fc.column == "label":
                reasons[i].append((lkey, label_value_problem(r["label"]) or "invalid label"))
            elif fc.column == "problem_key":
                reasons[i].append((ikey, f"duplicate prompt (same problem as line {first_seen[r['problem_key']]})"))
            elif fc.column == "prompt_tokens":
                n_tokens = int(df.at[i, "prompt_tokens"])
                reasons[i].append((ikey, f"overlong prompt: {n_tokens} tokens with the chat template > rollout.max_prompt_len={max_tokens}"))
            else:
                reasons[i].append((str(fc.column), str(fc.check)))
    # a JSON error also fails the prompt/label checks (they are None); report only the root cause
    for i, rs in reasons.items():
        if any(f == "<line>" for f, _ in rs):
            reasons[i] = [x for x in rs if x[0] == "<line>"]
    clean, bad = [], []
    for i, (line, obj, _err, raw) in enumerate(rows):
        if i in reasons:
            rs = reasons[i]
            bad.append(
                {
                    "file": str(path),
                    "line": line,
                    "fields": sorted({f for f, _ in rs}),
                    "reasons": [m for _, m in rs],
                    "raw": raw,
                }
            )
        else:
            clean.append({**obj, "_source_line": line})
    counts = collections.Counter(_reason_kind(m) for b in bad for m in b["reasons"])
    stats = {
        "file": str(path),
        "rows": len(rows),
        "bad_rows": len(bad),
        "bad_fraction": round(len(bad) / len(rows), 6) if rows else 0.0,
        "reasons": dict(counts.most_common()),
        "max_prompt_tokens": int(df["prompt_tokens"].max()) if df["prompt_tokens"].notna().any() else 0,
    }
    return clean, bad, stats


def _reason_kind(message: str) -> str:
    for key in ("not valid JSON", "not a JSON object", "duplicate prompt", "overlong prompt", "empty prompt",
                "invalid role", "missing prompt", "missing label", "empty label", "no user message"):
        if key in message:
            return key
    return message.split("(")[0].strip()[:60]


def contamination(train_rows: list[dict], eval_rows: list[dict], key: str, label_key: str = "label") -> dict[str, Any]:
    """Eval problems that also occur in train: the same normalized text, or an equivalent problem (the same
    numbers in any order, any wording, the same answer: `problem_signature`), e.g. 2+3 in eval vs 3+2 in train."""
    train_text = {normalize_problem(r[key]) for r in train_rows}
    train_sig = {s for r in train_rows if (s := problem_signature(r[key], r.get(label_key))) is not None}
    hits = []
    for r in eval_rows:
        if normalize_problem(r[key]) in train_text:
            hits.append((r, "same text"))
        elif problem_signature(r[key], r.get(label_key)) in train_sig:
            hits.append((r, "equivalent (same numbers and answer)"))
    return {
        "overlap": len(hits),
        "eval_rows": len(eval_rows),
        "fraction": round(len(hits) / len(eval_rows), 6) if eval_rows else 0.0,
        "equivalent": sum(1 for _, why in hits if why != "same text"),
        "examples": [{"line": r["_source_line"], "prompt": normalize_problem(r[key])[:200], "match": why}
                     for r, why in hits[:5]],
    }


def run_validate(data: DataSpec, max_prompt_len: int, run_dir: Path, train_path: Path, eval_path: Path,
                 tokenizer) -> dict[str, Any]:
    """Validate both splits, write clean + quarantine files and a report; return the summary section."""
    out = Path(run_dir) / "validate"
    cache = Path(run_dir) / ".cache" / "datasets"
    splits: dict[str, dict[str, Any]] = {}
    clean: dict[str, list[dict]] = {}
    for split, path in (("train", Path(train_path)), ("eval", Path(eval_path))):
        rows, bad, stats = validate_split(split, path, data, max_prompt_len, tokenizer, cache)
        atomic_write_jsonl(out / f"quarantine-{split}.jsonl", bad)
        stats["quarantine"] = str(out / f"quarantine-{split}.jsonl")
        stats["examples"] = [{"line": b["line"], "reasons": b["reasons"], "raw": b["raw"][:300]} for b in bad[:5]]
        splits[split] = stats
        clean[split] = rows
    cont = contamination(clean["train"], clean["eval"], data.input_key, data.label_key)
    section = {
        "rows": sum(s["rows"] for s in splits.values()),
        "bad_rows": sum(s["bad_rows"] for s in splits.values()),
        "contamination": cont,
        **splits,
    }
    failures = []
    for split, s in splits.items():
        if s["rows"] - s["bad_rows"] == 0:
            failures.append(f"{split}: no valid rows in {s['file']}")
        elif s["bad_fraction"] > data.max_bad_fraction:
            failures.append(
                f"{split}: {s['bad_rows']}/{s['rows']} rows bad ({s['bad_fraction']:.2%}) > data.max_bad_fraction="
                f"{data.max_bad_fraction:.2%}; reasons {s['reasons']}; see {s['quarantine']}"
            )
    if cont["fraction"] > data.max_contamination:
        failures.append(
            f"contamination: {cont['overlap']}/{cont['eval_rows']} eval prompts also appear in train "
            f"({cont['equivalent']} as equivalent problems: same numbers and answer, reordered or reworded) "
            f"({cont['fraction']:.2%} > data.max_contamination={data.max_contamination:.2%}); "
            f"first eval lines: {[e['line'] for e in cont['examples']]}"
        )
    section["passed"] = not failures
    atomic_write_json(out / "report.json", section)
    if failures:
        raise DataValidationError("data validation failed:\n" + "\n".join(f"  - {f}" for f in failures), section)
    # clean files last: their presence means validation passed
    for split, rows in clean.items():
        atomic_write_jsonl(out / f"{split}.jsonl", rows)
        section[split]["clean"] = str(out / f"{split}.jsonl")
    atomic_write_json(out / "report.json", section)
    return section
