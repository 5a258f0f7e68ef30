"""Synthetic tiny data: deterministic, DAPO/AIME row format, disjoint train/eval; how a rebuild is compared with the
shipped assets (the rebuild itself: tests/integration/test_tiny_assets.py)."""

from __future__ import annotations

import ast
import re

import pytest

from kimi_pipeline.data.rows import label_problem, normalize_problem, problem_signature, prompt_problem
from kimi_pipeline.data.synthetic import MathGenConfig, generate

from support.common import ROOT


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
        numbers = [int(n) for n in re.findall(r"\d+", text)]
        if "largest" in text.lower() or "maximum" in text.lower():
            assert int(row["label"]) == max(numbers)
        elif "smallest" in text.lower() or "minimum" in text.lower():
            assert int(row["label"]) == min(numbers)
        else:
            assert int(row["label"]) == sum(numbers)


def test_train_eval_disjoint_by_problem_not_just_by_text():
    """≥ 64 eval problems, none of which occurs in train reordered or reworded (the validate stage's key)."""
    train, evals = generate(MathGenConfig())
    assert len(evals) >= 64
    assert len({normalize_problem(r["prompt"]) for r in train}) == len(train)  # no duplicate rows
    train_sigs = {problem_signature(r["prompt"], r["label"]) for r in train}
    assert not {problem_signature(r["prompt"], r["label"]) for r in evals} & train_sigs
    texts = [(r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][0]["content"]).lower() for r in evals]
    assert any("larg" in t or "maxi" in t for t in texts) and any("small" in t or "mini" in t for t in texts)
    harder_train, _ = generate(MathGenConfig(max_operand=20, max_answer=40, ops=("+",), eval_problems=10))
    assert max(int(r["label"]) for r in harder_train) > 9
    dapo_train, _ = generate(MathGenConfig(wrapper="dapo"))
    assert dapo_train[0]["prompt"][0]["content"].startswith("Solve the following math problem step by step.")
    with pytest.raises(ValueError, match="unknown problem family"):
        generate(MathGenConfig(ops=("%",)))
    with pytest.raises(ValueError, match="leaves no training problems"):
        generate(MathGenConfig(ops=("+",), eval_problems=1000))


def test_problem_signature_ignores_order_and_wording():
    assert problem_signature("What is 2+3? Answer in \\boxed{}.", "5") == problem_signature(
        [{"role": "user", "content": "Find the sum of 3 and 2."}], " 5")
    assert problem_signature("What is 2+3?", "5") != problem_signature("What is 2+3?", "6")
    assert problem_signature("What is 7?", "7") is None  # one number says too little


def test_build_comparison_tells_data_from_trained_weights(tmp_path):
    """`make-tiny --check`'s split: data / tokenizer / config must be byte-identical; only the trained weights (and
    the manifest that hashes them) may differ in rounding and go to the behaviour check."""
    from kimi_pipeline.data.tiny_assets import compare_builds

    shipped, fresh = tmp_path / "shipped", tmp_path / "fresh"
    for root in (shipped, fresh):
        (root / "model").mkdir(parents=True)
        (root / "aime-tiny.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
        (root / "model" / "tokenizer.json").write_text("{}")
    (shipped / "model" / "model.safetensors").write_bytes(b"a")
    (fresh / "model" / "model.safetensors").write_bytes(b"b")
    (shipped / "model" / "MANIFEST.sha256").write_text("x")
    (fresh / "model" / "MANIFEST.sha256").write_text("y")
    got = compare_builds(fresh, shipped)
    assert got.differs == () and got.weights_differ == ("model/MANIFEST.sha256", "model/model.safetensors")
    (fresh / "aime-tiny.jsonl").write_text('{"prompt": "1+1", "label": "3"}\n')
    (fresh / "model" / "tokenizer.json").write_text("{ }")
    (fresh / "model" / "config.json").write_text("{}")  # missing from the shipped copy
    assert compare_builds(fresh, shipped).differs == ("aime-tiny.jsonl", "model/config.json", "model/tokenizer.json")


def test_core_library_never_imports_prefect():
    for path in (ROOT / "kimi_pipeline").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "prefect" or n.startswith("prefect.") for n in names), path
