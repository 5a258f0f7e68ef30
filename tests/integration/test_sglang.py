"""SGLang checked against SGLang itself: the launch commands every preset plans, parsed by the pinned release's own
`ServerArgs` parser (`make sglang-parser` installs it for the tests, without its GPU dependencies)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kimi_pipeline.recipes import load_recipe, preset_names
from kimi_pipeline.rl.engine.sglang import PARSER_PATH_VAR, parse_with_sglang, sglang_command
from kimi_pipeline.rl.launch import plan_launch

ROOT = Path(__file__).resolve().parents[2]
PINNED = (ROOT / "requirements-sglang.txt").read_text().split("==")[1].strip()


@pytest.fixture(scope="module")
def parser_dir() -> Path:
    d = Path(os.environ[PARSER_PATH_VAR])
    assert (d / "sglang").is_dir(), f"no sglang in {d}: run `make sglang-parser` (make test does)"
    return d


def _planned_commands(recipe) -> list[list[str]]:
    plan = plan_launch(recipe, "/ckpt")
    assert plan.ok, plan.problems
    return [list(n.command) for e in plan.engines for n in e.nodes]


@pytest.mark.parametrize("colocate", [True, False])
def test_every_preset_engine_command_parses_with_the_pinned_sglang(parser_dir, colocate):
    names = [n for n in preset_names() if load_recipe(n).rollout.engine == "sglang"]
    assert {"kimi-k2-instruct", "kimi-k2-thinking", "kimi-k2.5"} <= set(names)
    for name in names:
        recipe = load_recipe(name, [f"cluster.colocate={str(colocate).lower()}", "rollout.routing_replay=true"])
        commands = _planned_commands(recipe)
        if any(len(e.nodes) > 1 for e in plan_launch(recipe, "/ckpt").engines):
            assert any("--nnodes" in c for c in commands)  # the multi-node engines' commands are in the set
        parsed = parse_with_sglang(commands, recipe.sglang)
        assert parsed.version == PINNED, parsed.reason
        assert parsed.errors == ("",) * len(commands), (name, [e for e in parsed.errors if e])


def test_a_flag_sglang_does_not_know_fails_the_check(parser_dir):
    spec = load_recipe("kimi-k2.5").sglang
    cmd = sglang_command("/ckpt", spec, port=30000, gpus_per_node=8)
    parsed = parse_with_sglang([cmd + ["--cuda-graph-bs", "1", "2"], cmd + ["--no-such-flag"],
                                cmd + ["--tp-size", "eight"]], spec)
    assert "ambiguous option: --cuda-graph-bs" in parsed.errors[0]  # the name this project used before 0.5.23
    assert "unrecognized arguments: --no-such-flag" in parsed.errors[1]
    assert "--tp-size" in parsed.errors[2] and "invalid int value" in parsed.errors[2]


def test_without_an_importable_sglang_the_check_says_why(monkeypatch):
    monkeypatch.delenv(PARSER_PATH_VAR)
    spec = load_recipe("kimi-k2.5", ["sglang.python=/nonexistent/python"]).sglang
    parsed = parse_with_sglang([["--model-path", "/ckpt"]], spec)
    assert not parsed.checked and "/nonexistent/python" in parsed.reason and "make sglang-env" in parsed.reason
