"""One stage contract: every DAG stage is a `Stage` declared in its own module of `kimi_pipeline.stages` beside its
work, that module's `run`, which each Prefect task and CLI command calls by name (a call a reader can follow from
the task into the stage's code, no lookup in between); and the one runner (`stage_run`) around that call records
what every stage records: status and seconds, its section, the partial section a failing stage carries, a skip,
the debugging modes' own records, and the report handed to whoever publishes it."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import textwrap
from pathlib import Path

import pytest

from kimi_pipeline.errors import SectionError
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.recipes.recipe import Recipe
from kimi_pipeline.stages import DAG, STAGES, Skipped, Stage, StageReport, convert, stage_run, train

ROOT = Path(__file__).resolve().parents[2]


def _work(stage: Stage):
    """The stage's work: `run` of the module that declares it."""
    return importlib.import_module(f"kimi_pipeline.stages.{stage.name}").run


def test_each_stage_lives_in_its_own_module_and_declares_what_it_reads():
    assert STAGES == ("download", "validate", "convert", "cluster", "train", "export")
    sections = set(Recipe.model_fields)
    for position, stage in enumerate(DAG):
        module = importlib.import_module(f"kimi_pipeline.stages.{stage.name}")
        assert getattr(module, stage.name.upper()) is stage
        run = _work(stage)
        assert inspect.isfunction(run) and run.__module__ == module.__name__, f"{stage.name}: run is not its own"
        assert list(inspect.signature(run).parameters)[:2] == ["recipe", "run_dir"], stage.name
        assert set(stage.reads) <= sections, (stage.name, set(stage.reads) - sections)
        assert set(stage.needs) <= set(STAGES[:position]), f"{stage.name} needs a later stage: {stage.needs}"
        assert stage.report.key and callable(stage.report.render)


# Stages that hand the whole recipe to the owner of their work, whose reads are the whole recipe's: the cluster's
# bring-up runs the recipe's preflight and `kimi plan`; the training loop hands each actor its own sections.
WHOLE_RECIPE_OWNERS = {"cluster": "cluster.lifecycle.bring_up", "train": "rl.loop.run_training"}


def _sections_read(fn) -> set[str]:
    """The recipe sections `fn` reads: `recipe.<section>`, `recipe.section_dump("<section>", ...)`, and what a
    section record it builds with `Record.of(recipe)` reads. Fails on a call handed the whole recipe."""
    sections = set(Recipe.model_fields)
    out: set[str] = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "recipe":
            if node.attr in sections:
                out.add(node.attr)
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "section_dump":
            out |= {a.value for a in node.args if isinstance(a, ast.Constant)}
        elif isinstance(func, ast.Attribute) and func.attr == "of" and isinstance(func.value, ast.Name):
            out |= _sections_read(fn.__globals__[func.value.id].of)
        else:
            handed = [a for a in [*node.args, *(k.value for k in node.keywords)]
                      if isinstance(a, ast.Name) and a.id == "recipe"]
            assert not handed, f"{fn.__module__}.{fn.__name__} hands the whole recipe to {ast.unparse(func)}"
    return out


@pytest.mark.parametrize("stage", [s for s in DAG if s.name not in WHOLE_RECIPE_OWNERS], ids=lambda s: s.name)
def test_a_stage_declares_exactly_the_sections_its_code_reads(stage):
    """`reads` is what the stage's own code and the section records it builds read (its components receive
    those sections, never the recipe)."""
    read = _sections_read(_work(stage))
    assert set(stage.reads) == read, f"{stage.name}: declared {sorted(stage.reads)}, the code reads {sorted(read)}"


def test_the_section_scan_sees_records_dumps_and_a_handed_recipe():
    def reads_through_a_record(recipe):
        return Recipe.section_dump(recipe, "paths"), recipe.hub.offline, _Record.of(recipe)

    def hands_the_recipe(recipe):
        return print(recipe)

    assert _sections_read(reads_through_a_record) == {"paths", "hub", "eval"}
    with pytest.raises(AssertionError, match="hands the whole recipe to print"):
        _sections_read(hands_the_recipe)


# The command that runs each stage alone (`kimi <stage>`, `kimi cluster up`): its file, function and runner
COMMANDS = {
    "download": ("kimi_pipeline/cli.py", "download", "_stage_command"),
    "validate": ("kimi_pipeline/cli.py", "validate", "_stage_command"),
    "convert": ("kimi_pipeline/cli.py", "convert", "_stage_command"),
    "cluster": ("kimi_pipeline/cli_cluster.py", "up", "stage_run"),
    "train": ("kimi_pipeline/cli.py", "train", "_stage_command"),
    "export": ("kimi_pipeline/cli.py", "export", "_stage_command"),
}


def _calls_by_name(fn: ast.FunctionDef, runner: str, stage: Stage, work: str) -> bool:
    """Whether `fn` calls `<work>(recipe, ...)` itself inside `with <runner>(<STAGE>, recipe, ...)`, with the recipe
    the runner records: the stage's code is a call a reader follows from `fn`, not a lookup."""
    for block in (n for n in ast.walk(fn) if isinstance(n, ast.With)):
        for item in block.items:
            run = item.context_expr
            if not (isinstance(run, ast.Call) and ast.unparse(run.func) == runner and len(run.args) >= 2
                    and ast.unparse(run.args[0]) == stage.name.upper()):
                continue
            recipe = ast.unparse(run.args[1])
            calls = [n for statement in block.body for n in ast.walk(statement) if isinstance(n, ast.Call)]
            if any(ast.unparse(c.func) == work and c.args and ast.unparse(c.args[0]) == recipe for c in calls):
                return True
    return False


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _imports(tree: ast.Module) -> set[tuple[str | None, str, str | None]]:
    return {(n.module, a.name, a.asname) for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}


@pytest.mark.parametrize("stage", DAG, ids=lambda s: s.name)
def test_each_task_and_command_calls_its_stage_by_name(stage):
    """`tasks/<name>.py:<name>_task` calls `<name>.run(recipe, ...)` (the module `kimi_pipeline.stages.<name>`) inside
    `with stage_task(<NAME>, recipe, ...)`, and its command calls `stages.<name>.run(r, ...)` inside its runner's
    `with` (`kimi train`: `with _stage_command(TRAIN, r, ...)`)."""
    tasks = ast.parse((ROOT / "tasks" / f"{stage.name}.py").read_text())
    assert ("kimi_pipeline.stages", stage.name, None) in _imports(tasks)
    assert _calls_by_name(_function(tasks, f"{stage.name}_task"), "stage_task", stage, f"{stage.name}.run")
    path, command, runner = COMMANDS[stage.name]
    cli = ast.parse((ROOT / path).read_text())
    assert ("kimi_pipeline", "stages", None) in _imports(cli)
    assert _calls_by_name(_function(cli, command), runner, stage, f"stages.{stage.name}.run")


def test_the_call_scan_refuses_a_lookup_another_stage_and_another_recipe():
    stage = convert.CONVERT
    sources = {
        "by name": "def f(recipe, d):\n    with stage_task(CONVERT, recipe, d) as record:\n"
                   "        return record(convert.run(recipe, d))\n",
        "a lookup": "def f(recipe, d):\n    with stage_task(CONVERT, recipe, d) as record:\n"
                    "        return record(WORK['convert'](recipe, d))\n",
        "another stage": "def f(recipe, d):\n    with stage_task(TRAIN, recipe, d) as record:\n"
                         "        return record(convert.run(recipe, d))\n",
        "another recipe": "def f(recipe, d):\n    with stage_task(CONVERT, recipe, d) as record:\n"
                          "        return record(convert.run(other, d))\n",
        "outside the runner": "def f(recipe, d):\n    with stage_task(CONVERT, recipe, d) as record:\n"
                              "        pass\n    return convert.run(recipe, d)\n",
    }
    found = {k: _calls_by_name(_function(ast.parse(v), "f"), "stage_task", stage, "convert.run")
             for k, v in sources.items()}
    assert found == {"by name": True, "a lookup": False, "another stage": False, "another recipe": False,
                     "outside the runner": False}


class _Record:
    @classmethod
    def of(cls, recipe):
        return recipe.eval


TOY = Stage(name="validate", reads=("data",), needs=(), outputs=(),
            report=StageReport(key="toy", render=lambda s: f"rows: {s.get('rows')}", title="{recipe}: {rows} rows",
                               failed_title="failed at {rows}"))


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_the_runner_records_status_seconds_section_and_publishes_the_report(tmp_path):
    published = []

    def publish(report: StageReport, section: dict, failed: bool) -> None:
        published.append((report.key, report.render(section), failed))

    with stage_run(TOY, load_recipe("tiny"), tmp_path, publish=publish) as record:
        section = record({"rows": 7})
    summary = _summary(tmp_path)
    assert section == {"rows": 7} and summary["validate"] == {"rows": 7}
    assert summary["stages"]["validate"]["status"] == "completed" and summary["stages"]["validate"]["seconds"] >= 0
    assert published == [("toy", "rows: 7", False)]


def test_a_failure_carrying_its_section_is_recorded_and_reported(tmp_path):
    published = []
    with pytest.raises(SectionError, match="3 bad rows"):
        with stage_run(TOY, load_recipe("tiny"), tmp_path, publish=lambda r, s, failed: published.append(failed)):
            raise SectionError("3 bad rows", {"rows": 3, "bad": [1, 2, 3]})
    summary = _summary(tmp_path)
    assert (
        summary["stages"]["validate"]["status"] == "failed" and "3 bad rows" in summary["stages"]["validate"]["error"]
    )
    assert summary["validate"] == {"rows": 3, "bad": [1, 2, 3]} and published == [True]


def test_an_error_without_a_section_records_only_the_failure(tmp_path):
    with pytest.raises(RuntimeError):
        with stage_run(TOY, load_recipe("tiny"), tmp_path, publish=lambda *a: pytest.fail("nothing to publish")):
            raise RuntimeError("node lost")
    summary = _summary(tmp_path)
    assert summary["stages"]["validate"]["status"] == "failed" and "validate" not in summary


def test_a_block_that_records_no_section_fails(tmp_path):
    """A caller that calls the stage but forgets to hand its section over would otherwise report a stage that
    completed with nothing to show."""
    with pytest.raises(RuntimeError, match="recorded 0 sections, not one"):
        with stage_run(TOY, load_recipe("tiny"), tmp_path, publish=lambda *a: pytest.fail("nothing to publish")):
            pass
    assert _summary(tmp_path)["stages"]["validate"]["status"] == "failed"


def test_a_skip_and_a_debugging_mode_have_their_own_records(tmp_path):
    recipe = load_recipe("tiny")
    nothing = lambda *a: pytest.fail("a skipped stage publishes nothing")  # noqa: E731
    with stage_run(TOY, recipe, tmp_path, publish=nothing) as record:
        assert record(Skipped(skipped="not needed")) == {"skipped": "not needed"}
    assert _summary(tmp_path)["stages"]["validate"] == {"status": "skipped", "seconds": 0.0, "reason": "not needed"}
    assert _summary(tmp_path)["validate"] == {"skipped": "not needed"}
    with stage_run(TOY, recipe, tmp_path, record_as="replay") as record:
        record({"replayed": True})
    summary = _summary(tmp_path)
    assert summary["replay"] == {"replayed": True} and summary["stages"]["replay"]["status"] == "completed"
    assert summary["stages"]["validate"]["status"] == "skipped"  # the stage's own record, untouched


def test_a_recipe_that_loads_hf_weights_directly_skips_the_convert_stage(tmp_path):
    """Bridge mode (K2.5): the convert stage's own `run` says it skips (no manifest read, nothing converted)."""
    recipe = load_recipe("tiny", ["convert.mode=bridge"])
    with stage_run(convert.CONVERT, recipe, tmp_path) as record:
        record(convert.run(recipe, tmp_path))
    summary = _summary(tmp_path)
    assert summary["stages"]["convert"]["status"] == "skipped" and summary["convert"]["mode"] == "bridge"


def test_the_train_stage_debugging_modes_have_their_own_record_names():
    assert train.record_name() == "train"
    assert train.record_name(replay=Path("rollouts")) == "replay"
    assert train.record_name(rollout_only=True) == "rollout_only"
