"""Secrets never leave the process in text: every place text leaves it (summary.json, FAILED.md and the failure
webhook, Prefect artifacts, log records) passes through `redact`.

What is redacted: the values of the secret env vars (`secret_env.SECRET_ENVS`, read at each call, so a value set
later counts), values registered at run time (a Prefect Secret block's value, the engine key, the Ray token read
from its file), and text shaped like a credential whatever its value: a Hugging Face token (`hf_` + 20 or more
letters and digits), `NAME=value` / `'NAME': 'value'` for a secret env var's name, and an `Authorization: Bearer`
value. The shapes are kept narrow on purpose: a 40-hex W&B key looks like a git commit or a checksum, which a
report must keep, so W&B keys are redacted by value only.

Log records are redacted where they are made (a record factory), so every handler sees the same clean text: those
configured later too (Prefect's, Ray's), and a traceback attached to a record is redacted with it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any

from kimi_pipeline.util.secret_env import SECRET_ENVS

MIN_SECRET_LEN = 6  # shorter values (a test's "x", an unset-ish "0") would redact ordinary words
_NAMES = "|".join(SECRET_ENVS)
SHAPES = (
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"), "<hf-token>"),
    (re.compile(rf"\b({_NAMES})=(['\"]?)[^\s'\"]+"), r"\1=\2<\1>"),
    (re.compile(rf"(['\"])({_NAMES})\1(\s*:\s*)(['\"])[^'\"]+\4"), r"\1\2\1\3\4<\2>\4"),
    (re.compile(r"\b([Bb]earer)\s+[A-Za-z0-9._~+/-]{16,}=*"), r"\1 <redacted>"),
)

_registered: dict[str, str] = {}  # secret value -> its placeholder
_lock = threading.Lock()
_logs_redacted = False


def register_secret(value: str | None, name: str) -> None:
    """Redact `value` as `<name>` from now on in this process (a secret that is not in an env var: a Prefect Secret
    block's value, a key derived from one). Short or empty values are ignored."""
    if value and len(value.strip()) >= MIN_SECRET_LEN:
        with _lock:
            _registered[value.strip()] = f"<{name}>"


def _known() -> list[tuple[str, str]]:
    """(value, placeholder) of every secret this process knows, longest first (a value inside another is not
    replaced before the longer one)."""
    values = {var: (os.environ.get(var) or "").strip() for var in SECRET_ENVS}
    found = {v: f"<{var}>" for var, v in values.items() if len(v) >= MIN_SECRET_LEN}
    with _lock:
        found.update(_registered)
    return sorted(found.items(), key=lambda kv: -len(kv[0]))


def redact(text: str) -> str:
    """`text` with every known secret value and every credential-shaped string replaced by a placeholder."""
    for value, placeholder in _known():
        if value in text:
            text = text.replace(value, placeholder)
    for pattern, replacement in SHAPES:
        text = pattern.sub(replacement, text)
    return text


def redact_data(obj: Any) -> Any:
    """`obj` (JSON-like: dicts, lists, strings, numbers) with `redact` applied to every string in it."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: redact_data(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_data(v) for v in obj)
    return obj


def redact_exception(exc: BaseException) -> BaseException:
    """Redact the message of `exc` and of the exceptions it was raised from, in place, where the message is its
    string arguments (or an OSError's text and file names), so that whoever shows the exception later — Prefect's
    state message, a CLI's error line — reads the clean text. An exception that builds its message otherwise is
    left as it is: the places text leaves the process redact it there. Returns `exc`."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__str__ in (BaseException.__str__, OSError.__str__):
            e.args = tuple(redact(a) if isinstance(a, str) else a for a in e.args)
        if isinstance(e, OSError):
            for attr in ("strerror", "filename", "filename2"):
                if isinstance(value := getattr(e, attr), str):
                    setattr(e, attr, redact(value))
        e = e.__cause__ or e.__context__
    return exc


def _redact_record(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a record whose arguments do not format: logging reports it at emit
        return
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
        text = logging.Formatter().formatException(record.exc_info)
        record.exc_text = redact(text)  # handlers format the traceback from exc_text when it is set
    if record.stack_info:
        record.stack_info = redact(record.stack_info)


def install_log_redaction() -> None:
    """Redact every log record this process makes from now on (idempotent). Called by the entry points: the CLI,
    the flow, and each Ray worker of a run (its setup hook, `ray_worker_setup`)."""
    global _logs_redacted
    with _lock:
        if _logs_redacted:
            return
        make = logging.getLogRecordFactory()

        def redacting_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = make(*args, **kwargs)
            _redact_record(record)
            return record

        logging.setLogRecordFactory(redacting_factory)
        _logs_redacted = True


def ray_worker_setup() -> dict[str, str]:
    """The runtime_env a run's drivers give `ray.init`: each worker process of the job (every actor) redacts its log
    records before any actor code runs. A fresh dict per call: Ray rewrites the one it is given."""
    return {"worker_process_setup_hook": f"{__name__}.{install_log_redaction.__name__}"}
