""""Stage" means one thing in a name: a step of the DAG (download … export). A pipeline-parallel rank group is
always a *PP stage* (`pp_stage_layers`, `PPStageMemory`, megatron's `is_pipeline_first_stage`).

A static scan of every identifier the library defines or uses (names, attributes, arguments, functions,
classes, imports, keywords): one that contains "stage" must either carry the PP qualifier or be a DAG name
(a stage of `kimi_pipeline.stages.STAGES`, or a listed name of the DAG's contract and runner).
JSON keys and messages are not identifiers: `kimi plan --json` keeps its `stage` / `layers_per_stage` keys.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kimi_pipeline.stages import STAGES

ROOT = Path(__file__).resolve().parents[2]
SCAN_DIRS = ("kimi_pipeline", "tasks", "flows", "bench")
PP = re.compile(r"pp_stage|PPStage|pipeline_(first_|last_)?stage", re.IGNORECASE)
# the DAG's own helpers and errors (one line each: what stage they mean)
DAG_NAMES = {
    "stage", "stages", "STAGES",
    "Stage", "StageReport",  # stages.runner: a DAG stage's declaration and its report
    "stage_run",  # stages.runner: the one runner of every DAG stage, around its caller's call of the stage's `run`
    "stage_task",  # tasks.common: that runner for a DAG stage run as a Prefect task
    "_stage_command",  # cli: a DAG stage run alone by its command (`kimi train` …)
    "set_stage",  # RunSummary: one DAG stage's status
    "stage_error",  # rl.ray_errors: the train stage's error for an actor failure
    "stage_text", "_failed_stages",  # flows.notify: the DAG stages of a failed run
    "ConvertStageError",  # the convert stage failed
    "StageOrderError",  # a stage ran before the one it needs (download before validate …)
}


def _identifiers(tree: ast.AST):
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            yield n.id, n.lineno
        elif isinstance(n, ast.Attribute):
            yield n.attr, n.lineno
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield n.name, n.lineno
        elif isinstance(n, ast.arg):
            yield n.arg, n.lineno
        elif isinstance(n, ast.alias):
            yield (n.asname or n.name.split(".")[-1]), n.lineno
        elif isinstance(n, ast.keyword) and n.arg:
            yield n.arg, n.value.lineno


def ambiguous_stage_names(sources: dict[str, str]) -> list[str]:
    """`file:line name` for every identifier that says "stage" without saying which kind."""
    dag = DAG_NAMES | set(STAGES)
    bad = []
    for path, text in sources.items():
        for name, line in _identifiers(ast.parse(text)):
            if "stage" in name.lower() and not PP.search(name) and name not in dag:
                bad.append(f"{path}:{line} {name}")
    return sorted(set(bad))


def _library_sources() -> dict[str, str]:
    return {str(f.relative_to(ROOT)): f.read_text() for d in SCAN_DIRS for f in sorted((ROOT / d).rglob("*.py"))}


def test_every_stage_name_says_which_stage():
    bad = ambiguous_stage_names(_library_sources())
    assert not bad, (
        "identifiers that say 'stage' without saying which kind (a pipeline-parallel stage is pp_stage…/PPStage…; "
        "a new DAG helper goes in DAG_NAMES):\n" + "\n".join(bad)
    )


def test_the_scan_catches_an_unqualified_pipeline_stage():
    src = "def stage_layers(layout):\n    last_stage = layout.pp - 1\n    return pp_stage_layers(layout), stage_run\n"
    assert ambiguous_stage_names({"x.py": src}) == ["x.py:1 stage_layers", "x.py:2 last_stage"]


# The other words with one meaning each (issue: "plan" was five things, "launch" two):
# - "plan": what `kimi plan` computes (kimi_pipeline/plan); a module that says it uses that plan.
# - "launch": starting a distributed weight job's per-node agents (kimi_pipeline/weightjobs), or SGLang's own
#   `sglang.launch_server` (engine/sglang*.py); the recipe field `convert.launcher` says where weight jobs launch.
# - "job": a distributed weight job (kimi_pipeline/weightjobs and the ranks that run in one), or Ray's own
#   `ray job submit` (cluster/ray_submit.py and its CLI command).
WORDS = {
    "plan": (("kimi_pipeline/plan/",), ("kimi_pipeline.plan",), ()),
    "launch": (
        ("kimi_pipeline/weightjobs/", "kimi_pipeline/engine/sglang"),
        ("kimi_pipeline.weightjobs",),
        ("launcher",),
    ),
    "job": (
        (
            "kimi_pipeline/weightjobs/",
            "kimi_pipeline/cluster/ray_submit.py",
            "kimi_pipeline/cli_cluster.py",
            "kimi_pipeline/model/device.py",
        ),
        ("kimi_pipeline.weightjobs",),
        (),
    ),
}


def _imports_of(tree: ast.AST) -> set[str]:
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }


def words_out_of_place(sources: dict[str, str]) -> list[str]:
    """`file:line name` for an identifier saying plan / launch / job where that word means something else."""
    bad = []
    for path, text in sources.items():
        tree = ast.parse(text)
        imported = _imports_of(tree)
        for word, (homes, speakers, anywhere) in WORDS.items():
            if path.startswith(homes) or any(m.startswith(speakers) for m in imported):
                continue
            bad += [
                f"{path}:{line} {name}"
                for name, line in _identifiers(tree)
                if word in name.lower() and name not in anywhere
            ]
    return sorted(set(bad))


def test_plan_launch_and_job_each_mean_one_thing():
    bad = words_out_of_place(_library_sources())
    assert not bad, "identifiers using plan / launch / job for another concept (see WORDS):\n" + "\n".join(bad)


def test_the_word_scan_catches_a_second_meaning():
    src = "def lay_out(recipe):\n    launch_plan = place(recipe)\n    return launch_plan\n"
    assert words_out_of_place({"kimi_pipeline/rl/x.py": src}) == [
        "kimi_pipeline/rl/x.py:2 launch_plan",
        "kimi_pipeline/rl/x.py:3 launch_plan",
    ]
    assert words_out_of_place({"kimi_pipeline/plan/x.py": "make_plan = 1\n"}) == []
