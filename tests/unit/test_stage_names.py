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


# One word, one meaning for the rest of the house's vocabulary:
# - a module's file name names one module: `python -m`, log names and a reader's search all say which;
# - `spec` is the model (`ModelSpec`); any other recipe section is called by its section's name (`parallel`,
#   `convert`, `sglang`, `rules`, …);
# - a function's parameter never takes the function's own name (`def rollout(…, rollout)` hid the function);
# - the sections a component receives are one shape: a frozen `XSections` dataclass built by `XSections.of(recipe)`.
ONE_FILE_NAME_EXCEPTIONS = {"__init__.py", "__main__.py"}


def duplicate_module_names(root: Path) -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = {}
    for f in sorted(root.rglob("*.py")):
        if f.name not in ONE_FILE_NAME_EXCEPTIONS:
            by_name.setdefault(f.name, []).append(str(f.relative_to(root.parent)))
    return {k: v for k, v in by_name.items() if len(v) > 1}


def test_no_two_library_modules_share_a_file_name():
    dupes = duplicate_module_names(ROOT / "kimi_pipeline")
    assert not dupes, f"modules sharing a file name (name each for what it holds): {dupes}"


def misused_words(sources: dict[str, str]) -> list[str]:
    """`file:line function: reason` for a `spec` parameter that is not the model, a parameter named as its own
    function, and a recipe-reading `of` classmethod outside an `XSections` dataclass."""
    bad = []
    for path, text in sources.items():
        tree = ast.parse(text)
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
                    annotation = ast.unparse(a.annotation) if a.annotation else None
                    if a.arg == "spec" and annotation != "ModelSpec":
                        bad.append(f"{path}:{a.lineno} {fn.name}: `spec: {annotation}` (spec is the ModelSpec)")
                    if a.arg == fn.name:
                        bad.append(f"{path}:{a.lineno} {fn.name}: a parameter named as its function")
            if isinstance(fn, ast.ClassDef):
                for m in fn.body:
                    reads_recipe = isinstance(m, ast.FunctionDef) and m.name == "of" and len(m.args.args) > 1 \
                        and m.args.args[1].arg == "recipe"
                    if reads_recipe and not fn.name.endswith("Sections"):
                        bad.append(f"{path}:{m.lineno} {fn.name}.of: the sections a component reads are `XSections`")
    return sorted(bad)


def test_spec_means_the_model_and_no_parameter_hides_its_function():
    bad = misused_words(_library_sources())
    assert not bad, "words used for another meaning:\n" + "\n".join(bad)


def test_the_misused_word_scan_catches_each_kind():
    src = ("def rollout(client, rollout):\n    pass\n"
           "def lay_out(spec: ConvertSpec):\n    pass\n"
           "class EngineSettings:\n    @classmethod\n    def of(cls, recipe):\n        pass\n"
           "def build(spec: ModelSpec):\n    pass\n")
    assert misused_words({"x.py": src}) == [
        "x.py:1 rollout: a parameter named as its function",
        "x.py:3 lay_out: `spec: ConvertSpec` (spec is the ModelSpec)",
        "x.py:7 EngineSettings.of: the sections a component reads are `XSections`",
    ]
