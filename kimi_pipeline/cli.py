"""`kimi`: run the pipeline, inspect and check recipes, run single stages."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from kimi_pipeline import stages  # `stages.<name>.run`: the stage commands have the stages' names
from kimi_pipeline.cli_cluster import cluster_app
from kimi_pipeline.cli_recipes import RECIPE_HELP, SET_HELP, recipe_or_exit, recipe_or_problems
from kimi_pipeline.cluster.cluster_errors import ClusterConfigError
from kimi_pipeline.cluster.lifecycle import attach_driver
from kimi_pipeline.cluster.preflight import report_markdown, run_preflight
from kimi_pipeline.cluster.run_guard import mark_interrupted, stop_children, stop_on_signals
from kimi_pipeline.data.tiny_assets import BASE_POLICY_TOLERANCE, build_tiny_assets_reproducibly, compare_builds
from kimi_pipeline.errors import PermanentError
from kimi_pipeline.eval.record import EvalSections, base_policy_scores, evaluate_checkpoint
from kimi_pipeline.hub.fetch import DownloadError
from kimi_pipeline.plan import plan_command
from kimi_pipeline.recipes import (
    Recipe,
    RecipeError,
    check_recipe,
    load_recipe,
    pipeline_layers,
    preset_names,
    recipe_to_yaml,
)
from kimi_pipeline.report.progress import echo_to_stderr, set_quiet
from kimi_pipeline.rl.rehearse import refused_layout, run_rehearsal
from kimi_pipeline.stages import (
    CONVERT,
    DOWNLOAD,
    EXPORT,
    STAGES,
    TRAIN,
    VALIDATE,
    Record,
    Stage,
    prepare_run,
    release_run,
    stage_run,
)
from kimi_pipeline.util.files import atomic_write_json, atomic_write_text
from kimi_pipeline.util.paths import new_run_dir, resolve_path
from kimi_pipeline.util.prefect_env import configure_prefect_env
from kimi_pipeline.util.redact import install_log_redaction, redact

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Kimi-K2-family RL post-training pipeline.")
recipe_app = typer.Typer(no_args_is_help=True, help="List, show and check recipes.")
data_app = typer.Typer(no_args_is_help=True, help="Project data: the tiny recipe's shipped assets.")
app.add_typer(recipe_app, name="recipe")
app.add_typer(data_app, name="data")
app.add_typer(cluster_app, name="cluster")
app.command("plan", help="Memory and time model of a recipe's layout (fits or not, before launch).")(plan_command)
console = Console()
err = Console(stderr=True, soft_wrap=True)  # an error names paths and commands: a wrapped path cannot be copied
T = TypeVar("T")

QUIET_HELP = "No per-rollout / per-eval progress lines (and only warnings from Prefect)."


@contextmanager
def _exit_on_expected_errors() -> Iterator[None]:
    """Expected failures (bad input, unreachable source) print their message, not a traceback."""
    try:
        yield
    except (PermanentError, DownloadError) as e:
        err.print(f"error: {redact(str(e))}", highlight=False, markup=False)
        raise typer.Exit(1) from None


def _run_or_exit(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call a command's work; an expected failure prints its message, not a traceback."""
    with _exit_on_expected_errors():
        return fn(*args, **kwargs)


@contextmanager
def _run_dir(recipe, run_dir: Path) -> Iterator[Path]:
    """The run directory, this command's alone until it ends (its lock); one another run holds is an error line."""
    path = _run_or_exit(prepare_run, recipe, run_dir)
    try:
        yield path
    finally:
        release_run(path)


@contextmanager
def _stage_command(stage: Stage, recipe: Recipe, run_dir: Path,
                   record_as: str | None = None) -> Iterator[tuple[Path, Record]]:
    """The block of a command that runs one stage alone: its run directory (`_run_dir`), the one runner around the
    command's call of the stage's `run` (summary.json, timing, errors), and an expected failure as one line."""
    with _run_dir(recipe, run_dir) as path, _exit_on_expected_errors():
        with stage_run(stage, recipe, path, record_as=record_as) as record:
            yield path, record


@app.command()
def run(
    recipe: str = typer.Option("tiny", "--recipe", "-r", help=RECIPE_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Run directory (default: <base_dir>/<time>-<recipe>)."),
    until: Optional[str] = typer.Option(None, "--until", help="Stop after this stage."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_HELP),
) -> None:
    """Run the whole pipeline in-process (Prefect flow `kimi`, ephemeral API)."""
    r = recipe_or_exit(recipe, set_)

    if until is not None and until not in STAGES:
        err.print(f"error: --until must be one of {', '.join(STAGES)}")
        raise typer.Exit(2)
    if quiet:
        os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
    set_quiet(quiet)
    configure_prefect_env()
    from flows.kimi import kimi

    console.print(f"recipe [bold]{r.name}[/bold]; Prefect home {os.environ['PREFECT_HOME']}")
    run_dir = run_dir or new_run_dir(r.paths.base_dir, r.name)  # known here, so an interrupted run can be marked
    stop_on_signals()
    try:
        state = kimi(recipe=recipe, overrides=list(set_), run_dir=str(run_dir), until=until, return_state=True)
    except KeyboardInterrupt as e:  # SIGINT, SIGTERM, SIGHUP: the flow has unwound; stop what it left, mark the run
        stopped = stop_children()
        marked = mark_interrupted(run_dir, os.getpid()) if (run_dir / "summary.json").is_file() else []
        why = str(e) or "stopped by SIGINT: re-run with the same --run-dir to resume"  # Ctrl-C's carries no text
        err.print(f"run stopped ({why}); {stopped} process(es) it started stopped; stage(s) marked "
                  f"interrupted: {', '.join(marked) or 'none'}; run directory {run_dir}", highlight=False, markup=False)
        raise typer.Exit(130) from None
    result = state.result(raise_on_failure=False)
    out = result if isinstance(result, dict) else {}
    rd = out.get("run_dir") or (str(run_dir) if run_dir else None)
    if rd:
        console.print(f"run directory: {rd}\nsummary: {Path(rd) / 'summary.json'}\nreport:  {Path(rd) / 'summary.md'}")
    if not state.is_completed():
        stop_children()  # anything the failed flow left running (its temporary Prefect server is stopped at exit)
        err.print(f"[red]flow {state.name}:[/red] {redact(str(result))}", markup=True, highlight=False)
        raise typer.Exit(1)


@app.command()
def serve(
    port: int = typer.Option(4200, "--port", "-p", help="Server port on 127.0.0.1 (0 = any free port)."),
    schedule: bool = typer.Option(True, "--schedule/--no-schedule", help="Activate prefect.yaml's nightly cron."),
) -> None:
    """Local Prefect server (loopback) + deployment kimi/full: UI, nightly schedule, `prefect deployment run`."""
    configure_prefect_env()
    from flows.serve import ServeError, serve_local  # Prefect: imported after its settings are in the environment

    try:
        code = serve_local(port=port, schedule=schedule)
    except ServeError as e:
        err.print(f"error: {e}", highlight=False, markup=False)
        raise typer.Exit(1) from None
    raise typer.Exit(code)


@app.command()
def download(
    recipe: str = typer.Option("tiny", "--recipe", "-r", help=RECIPE_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    run_dir: Path = typer.Option(..., "--run-dir"),
) -> None:
    """Stage `download` alone (HF token from HF_TOKEN)."""

    r = recipe_or_exit(recipe, set_)
    with _stage_command(DOWNLOAD, r, run_dir) as (path, record):
        section = record(stages.download.run(r, path))
    console.print_json(json.dumps(section))


@app.command()
def validate(
    recipe: str = typer.Option("tiny", "--recipe", "-r", help=RECIPE_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    run_dir: Path = typer.Option(..., "--run-dir"),
) -> None:
    """Stage `validate` alone (after `download` in the same run dir)."""

    r = recipe_or_exit(recipe, set_)
    with _stage_command(VALIDATE, r, run_dir) as (path, record):
        section = record(stages.validate.run(r, path))
    console.print_json(json.dumps({k: v for k, v in section.items() if k not in ("train", "eval")}))


@app.command()
def convert(
    recipe: str = typer.Option("tiny", "--recipe", "-r", help=RECIPE_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    run_dir: Path = typer.Option(..., "--run-dir"),
) -> None:
    """Stage `convert` alone: HF → torch_dist over the recipe's conversion nodes, verified."""

    r = recipe_or_exit(recipe, set_)
    with _stage_command(CONVERT, r, run_dir) as (path, record):
        section = record(stages.convert.run(r, path))
    console.print_json(json.dumps(section, default=str))


@app.command()
def train(
    recipe: str = typer.Option("tiny", "--recipe", "-r", help=RECIPE_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    run_dir: Path = typer.Option(..., "--run-dir"),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Default: the run's cluster stage."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_HELP),
    replay_rollouts: Optional[Path] = typer.Option(
        None, "--replay-rollouts", help="Train on the rollouts saved in DIR (a run's train/rollouts, recorded with "
        "--set rollout.save_data=true) instead of generating: no engines; same gradients and metrics as the run that "
        "recorded them; its metrics and checkpoints go to the run dir's replay/."),
    rollout_only: bool = typer.Option(
        False, "--rollout-only", help="Generate and score rollouts with the starting policy, no training (rows in "
        "the run dir's rollout-only/metrics.jsonl; with rollout.save_data=true, rollouts to replay)."),
) -> None:
    """Stage `train` alone (after convert + cluster in the same run dir); resumes from its checkpoints."""

    r = recipe_or_exit(recipe, set_)
    set_quiet(quiet)
    echo_to_stderr()
    record_as = stages.train.record_name(replay_rollouts, rollout_only)  # the debugging modes keep their own records
    with _stage_command(TRAIN, r, run_dir, record_as) as (path, record):
        section = record(stages.train.run(r, path, ray_address=ray_address, replay=replay_rollouts,
                                          rollout_only=rollout_only))
    console.print_json(json.dumps(section, default=str))


@app.command()
def export(
    recipe: str = typer.Option("tiny", "--recipe", "-r", help=RECIPE_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    run_dir: Path = typer.Option(..., "--run-dir"),
    checkpoint: Optional[Path] = typer.Option(
        None, "--checkpoint", help="torch_dist dir (default: the run's training checkpoints)."
    ),
    step: Optional[int] = typer.Option(None, "--step", help="Iteration to export (default: latest)."),
) -> None:
    """Stage `export` alone: a training checkpoint → INT4 compressed-tensors HF directory, verified."""

    r = recipe_or_exit(recipe, set_)
    with _stage_command(EXPORT, r, run_dir) as (path, record):
        section = record(stages.export.run(r, path, checkpoint or path / "train" / "checkpoints", step=step))
    console.print_json(json.dumps(section, default=str))


@app.command()
def rehearse(
    recipe: str = typer.Argument(..., help=RECIPE_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    out: Path = typer.Option(Path("rehearsal"), "--out", help="where launch-plan.json / launch-plan.md go"),
    json_out: bool = typer.Option(False, "--json", help="print launch-plan.json instead of the summary"),
    stand_in_nodes: int = typer.Option(
        1, "--stand-in-nodes", min=1, help="start stand-in actors for the ranks and engines of this many nodes"
    ),
) -> None:
    """Launch rehearsal: the train stage's own placement and actor options on a simulated cluster of the
    recipe's shape (nodes × GPUs as Ray resources, no GPUs, no weights). Exit 1 when the launch would fail."""

    out = out / recipe.replace("/", "_").removesuffix(".yaml")
    r = recipe_or_problems(recipe, set_)
    d = refused_layout(recipe, r.problems, out) if isinstance(r, RecipeError) else _run_or_exit(run_rehearsal, r, out)
    if json_out:
        typer.echo(json.dumps(d, indent=1, default=str))
    else:
        status = "[green]ok[/green]" if d["ok"] else "[red]NOT OK[/red]"
        console.print(f"{d['recipe']}: {status} — GPUs requested {d.get('gpus_requested')} of "
                      f"{d.get('gpus_available', '?')} available; {len(d.get('ranks', []))} trainer ranks, "
                      f"{len(d.get('engines', []))} engines; rank 0 / MASTER_ADDR on node {d.get('master_addr_node')}"
                      f"; {len(d.get('observed', []))} stand-in actors started", highlight=False)
        if d.get("sglang_parser"):
            console.print(f"  SGLang commands: {d['sglang_parser']}", highlight=False, markup=False)
        for p in d.get("problems", []):
            console.print(f"  - {p['field']}: {p['message']}", highlight=False, markup=False)
        console.print(f"wrote {out / 'launch-plan.json'} and {out / 'launch-plan.md'}", highlight=False)
    if not d["ok"]:
        raise typer.Exit(1)


@app.command()
def preflight(
    recipe: str = typer.Argument(..., help=RECIPE_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Default: the recipe's cluster.address."),
    json_out: bool = typer.Option(False, "--json", help="print the report as JSON instead of the table"),
    out: Optional[Path] = typer.Option(None, "--out", help="also write preflight.json / preflight.md here"),
    timeout_s: float = typer.Option(
        120.0, "--timeout", help="seconds each probe call may take (a node that does not answer is named)"
    ),
    join_timeout_s: float = typer.Option(
        120.0,
        "--join-timeout",
        help="seconds every rank has to join the collective (the nodes whose ranks did not are named)",
    ),
    fast: bool = typer.Option(
        False, "--fast", help="no collective, a small shared-file check (what the cluster stage runs)"
    ),
) -> None:
    """Check the recipe's real cluster before a run holds it: one probe per node (GPUs, software versions, shared
    base_dir, free space, RAM and /dev/shm, ports between nodes) and a collective over every rank of the layout.
    Exit 1 naming each failed check, the nodes it failed on and the fix."""

    r = recipe_or_exit(recipe, set_)
    address = ray_address or r.cluster.address
    if not address:
        err.print(f"error: {r.name} names no cluster (cluster.address is unset): pass --ray-address HEAD:6379, or let "
                  "the cluster stage bring up the embedded one (it runs the fast preflight itself)", highlight=False,
                  markup=False)
        raise typer.Exit(1)
    try:
        address = attach_driver(address)
    except ClusterConfigError as e:
        err.print(f"error: {e}", highlight=False, markup=False)
        raise typer.Exit(1) from None
    report = _run_or_exit(
        lambda: run_preflight(
            r,
            address,
            fast=fast,
            timeout_s=timeout_s,
            join_timeout_s=join_timeout_s,
            progress=lambda m: err.print(m, highlight=False, markup=False),
        )
    )
    if out is not None:
        atomic_write_json(out / "preflight.json", report)
        atomic_write_text(out / "preflight.md", report_markdown(report))
    if json_out:
        typer.echo(json.dumps(report, indent=1, default=str))
    else:
        typer.echo(report_markdown(report))
    for line in report["failed"]:
        err.print(f"FAILED {line}", highlight=False, markup=False)
    if not report["ok"]:
        raise typer.Exit(1)


@app.command("eval")
def eval_(
    checkpoint: Path = typer.Option(..., "--checkpoint", help="HF directory or torch_dist checkpoint (dir or iter_N)."),
    recipe: str = typer.Option("tiny", "--recipe", "-r", help=RECIPE_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    data: Optional[Path] = typer.Option(None, "--data", help="AIME-format jsonl (default: the recipe's eval set)."),
    model_dir: Optional[Path] = typer.Option(None, "--model-dir", help="HF config + tokenizer dir (torch_dist only)."),
    out: Path = typer.Option(
        Path("runs/eval"),
        "--out",
        help="Run directory: eval.jsonl and the per-problem tables go to OUT/eval/ (as in a run).",
    ),
) -> None:
    """Evaluate any checkpoint on an AIME-format set: avg@n, pass@1, pass@n, maj@n."""

    r = recipe_or_exit(recipe, set_)
    source = r.data.eval
    data_file = data or (resolve_path(source.path) / (source.filename or "") if source.kind == "local" else None)
    if data_file is None:
        err.print("error: the recipe's eval set is on the hub; pass --data FILE (or run `kimi download` first)")
        raise typer.Exit(2)
    mdir = model_dir or (resolve_path(r.hub.model.path) if r.hub.model.kind == "local" else None)
    result = _run_or_exit(lambda: evaluate_checkpoint(EvalSections.of(r), checkpoint, out, model_dir=mdir,
                                                      data_file=Path(data_file)))
    console.print_json(json.dumps(result, default=str))


@recipe_app.command("list")
def recipe_list() -> None:
    """The presets."""
    table = Table("name", "description")
    for name in preset_names():
        table.add_row(name, load_recipe(name, check=False).description)
    console.print(table)


@recipe_app.command("show")
def recipe_show(
    name: str = typer.Argument(..., help=RECIPE_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Print the fully resolved recipe (YAML, or JSON with --json)."""
    r = recipe_or_exit(name, set_, check=False)
    if as_json:
        print(json.dumps(r.worker_dump(), indent=2))
    else:
        print(recipe_to_yaml(r), end="")


@recipe_app.command("check")
def recipe_check(
    name: str = typer.Argument(..., help=RECIPE_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Validate a recipe's layout and consistency; exit 1 naming each bad field."""
    r = recipe_or_exit(name, set_, check=False)
    problems = check_recipe(r)
    if problems:
        err.print(f"[red]recipe {r.name} is invalid:[/red]", markup=True)
        for p in problems:
            err.print(f"  - {p}", highlight=False, markup=False)
        raise typer.Exit(1)
    parallel = r.parallel
    split = pipeline_layers(r.model.num_layers, parallel.pp, parallel.decoder_first_pipeline_num_layers,
                            parallel.decoder_last_pipeline_num_layers)
    console.print(
        f"[green]ok[/green] {r.name}: {r.cluster.nodes}×{r.cluster.gpus_per_node} {r.cluster.device}, "
        f"TP{parallel.tp} PP{parallel.pp} CP{parallel.cp} DP{r.data_parallel_size} EP{parallel.ep} "
        f"ETP{parallel.etp}, layers per pipeline stage {split}, "
        f"global batch {r.global_batch_size}",
        highlight=False,
    )


@data_app.command("make-tiny")
def data_make_tiny(
    out: Path = typer.Option(Path("data/tiny"), "--out"),
    check: bool = typer.Option(False, "--check", help="Rebuild in a temp dir and compare with --out."),
) -> None:
    """(Re)build the tiny recipe's datasets, tokenizer, config.json and warm-started base policy (seeded).

    --check: data, tokenizer and config must match a fresh build byte for byte; the trained base policy must match
    byte for byte or, where this CPU rounds differently (another vendor's MKL/ATen kernels), behave like the shipped
    one: its step-0 eval (sampled avg@n) and greedy score on the tiny eval set within BASE_POLICY_TOLERANCE."""

    if not check:
        build_tiny_assets_reproducibly(out)
        console.print(f"wrote {out}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "tiny"
        build_tiny_assets_reproducibly(fresh)
        cmp = compare_builds(fresh, out)
        if cmp.differs:
            err.print(f"differs from a fresh build: {', '.join(cmp.differs)}")
            raise typer.Exit(1)
        if not cmp.weights_differ:
            console.print("shipped tiny assets match a fresh build byte for byte")
            return
        recipe, eval_file = load_recipe("tiny"), out / "aime-tiny.jsonl"
        sections = EvalSections.of(recipe)
        shipped = base_policy_scores(sections, out / "model", eval_file, Path(tmp) / "eval-shipped")
        rebuilt = base_policy_scores(sections, fresh / "model", eval_file, Path(tmp) / "eval-fresh")
    gaps = {k: abs(rebuilt[k] - shipped[k]) for k in BASE_POLICY_TOLERANCE}
    line = ", ".join(f"{k} {shipped[k]:.3f} shipped vs {rebuilt[k]:.3f} rebuilt (gap {gaps[k]:.3f}, tolerance "
                     f"{BASE_POLICY_TOLERANCE[k]:.3f})" for k in BASE_POLICY_TOLERANCE)
    if any(gaps[k] > BASE_POLICY_TOLERANCE[k] for k in gaps):
        err.print(f"the rebuilt base policy behaves differently from the shipped one on {eval_file}: {line}")
        raise typer.Exit(1)
    console.print(f"shipped tiny assets match a fresh build: data, tokenizer and config byte for byte; the base "
                  f"policy's weights differ in rounding ({', '.join(cmp.weights_differ)}) but it behaves alike: {line}")


def main() -> None:  # console-script entry point
    install_log_redaction()  # before any command logs: the in-process flow, `kimi serve`, single stages
    app()


if __name__ == "__main__":
    main()
