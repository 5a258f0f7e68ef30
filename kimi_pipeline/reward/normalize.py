"""Answer normalization and the in-process checks: canonical strings, exact numbers, forms too risky for sympy."""

from __future__ import annotations

import re
from fractions import Fraction

from kimi_pipeline.reward.extract import BOX_COMMANDS, braced_after

MAX_LABEL_CHARS = 1024

_SIMPLE_REPLACEMENTS = (
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("\\displaystyle", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\%", ""),
    ("%", ""),
    ("\\$", ""),
    ("$", ""),
    ("\\!", ""),
    ("\\,", " "),
    ("\\;", " "),
    ("\\:", " "),
    ("\\ ", " "),
    ("~", " "),
    ("{,}", ""),
    ("\n", " "),
)
_UNIT_SUFFIX = re.compile(r"(.+?)\s*\\(?:text|mbox)\{(?:\s+[A-Za-z]|\s*[A-Za-z]{2,})[A-Za-z\s]*\}")  # 5\text{ cm}
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_CMD_SPACE = re.compile(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL = re.compile(r"[+-]?(?:\d{1,40}(?:\.\d{0,40})?|\.\d{1,40})")
_LATEX_FRAC = re.compile(r"([+-]?)\\frac\{([+-]?\d{1,40})\}\{([+-]?\d{1,40})\}")
_SLASH_FRAC = re.compile(r"([+-]?\d{1,40})/([+-]?\d{1,40})")
_CHOICE = re.compile(r"\(([A-Za-z])\)")
_EXPLOSIVE = re.compile(
    r"\^\s*\{[^{}]*[\^!]"  # power tower / factorial in an exponent: 9^{9^{9}}
    r"|\^\s*\{?\s*\d{6,}"  # six-digit exponent: 3^{123456789}
    r"|(?:\d{6,}|[)}\]])\s*!"  # factorial of a six-digit number or of an expression
    r"|\\uparrow"
)


def _unwrap_box(s: str) -> str:
    """``\\boxed{\\boxed{7}}`` -> ``7`` (only when the box spans the whole string)."""
    for _ in range(8):
        s = s.strip()
        cmd = next((c for c in BOX_COMMANDS if s.startswith(c)), None)
        group = braced_after(s, len(cmd)) if cmd else None
        if group is None or group[1] != len(s) - 1:
            return s
        s = group[0]
    return s


def normalize_answer(s: str) -> str:
    """Canonical string for comparison (Hendrycks/DAPO-style), careful not to merge ``\\pi r`` into ``\\pir``."""
    s = _unwrap_box(str(s)[:MAX_LABEL_CHARS])
    for a, b in _SIMPLE_REPLACEMENTS:
        s = s.replace(a, b)
    s = s.strip()
    m = _UNIT_SUFFIX.fullmatch(s)
    if m:
        s = m.group(1)
    for _ in range(4):
        t = _TEXT_CMD.sub(r"\1", s)
        if t == s:
            break
        s = t
    s = _CMD_SPACE.sub("\\1\x00", s)
    s = re.sub(r"\s+", "", s).replace("\x00", " ")
    parts = s.split("=")
    if len(parts) == 2 and 0 < len(parts[0]) <= 2:
        s = parts[1]  # "x=5" -> "5"
    s = s.rstrip(".")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    m = _CHOICE.fullmatch(s)
    if m:
        s = m.group(1)
    if s.startswith("+"):
        s = s[1:]
    return s


def as_number(s: str) -> Fraction | None:
    """Exact value of a normalized plain number (int, decimal, a/b, \\frac{a}{b}); None otherwise.

    Bounded digit counts: no exponent notation, so ``1e999999999`` can never be expanded."""
    if _DECIMAL.fullmatch(s):
        return Fraction(s)
    m = _LATEX_FRAC.fullmatch(s) or _SLASH_FRAC.fullmatch(s)
    if m:
        sign, num, den = (m.group(1), m.group(2), m.group(3)) if m.re is _LATEX_FRAC else ("", m.group(1), m.group(2))
        if int(den) == 0:
            return None
        value = Fraction(int(num), int(den))
        return -value if sign == "-" else value
    return None


def answer_key(answer: str | None) -> str | None:
    """A key under which equal answers collide (for majority voting): the exact value if numeric."""
    if answer is None:
        return None
    s = normalize_answer(answer)
    if not s:
        return None
    value = as_number(s)
    return f"#{value}" if value is not None else s


def too_risky(pred: str) -> bool:
    """Forms that only ever explode in sympy: 0 without trying (the time limit would catch them
    too, but each costs a full timeout and a worker restart)."""
    return bool(_EXPLOSIVE.search(pred))
