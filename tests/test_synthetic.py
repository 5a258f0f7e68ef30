"""Synthetic tiny data: deterministic, DAPO/AIME row format, disjoint train/eval; shipped assets reproducible."""

from __future__ import annotations

import ast
import re

from typer.testing import CliRunner

from kimi_pipeline.cli import app
from kimi_pipeline.data.rows import label_problem, normalize_problem, prompt_problem
from kimi_pipeline.data.synthetic import MathGenConfig, generate

from conftest import ROOT


def test_deterministic_and_seeded():
    assert generate(MathGenConfig(seed=3)) == generate(MathGenConfig(seed=3))
    assert generate(MathGenConfig(seed=3)) != generate(MathGenConfig(seed=4))


def test_row_format_and_answers():
    train, evals = generate(MathGenConfig(string_prompt_fraction_train=0.5))
    assert any(isinstance(r["prompt"], str) for r in train) and any(isinstance(r["prompt"], list) for r in train)
    for row in train + evals:
        assert set(row) == {"prompt", "label"} and prompt_problem(row["prompt"]) is None
        assert label_problem(row["label"]) is None and 0 <= int(row["label"]) <= 9
        text = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][0]["content"]
        assert "\\boxed{}" in text and re.search(r"\d", text)


def test_train_eval_disjoint_and_knobs():
    train, evals = generate(MathGenConfig())
    assert not {normalize_problem(r["prompt"]) for r in evals} & {normalize_problem(r["prompt"]) for r in train}
    harder_train, _ = generate(MathGenConfig(max_operand=20, max_answer=40, ops=("+",)))
    assert max(int(r["label"]) for r in harder_train) > 9
    dapo_train, _ = generate(MathGenConfig(wrapper="dapo"))
    assert dapo_train[0]["prompt"][0]["content"].startswith("Solve the following math problem step by step.")


def test_shipped_tiny_assets_match_a_fresh_build():
    res = CliRunner().invoke(app, ["data", "make-tiny", "--check", "--out", str(ROOT / "data" / "tiny")])
    assert res.exit_code == 0, res.output


def test_core_library_never_imports_prefect():
    for path in (ROOT / "kimi_pipeline").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "prefect" or n.startswith("prefect.") for n in names), path
