"""`kimi cluster …`: bring a run's Ray cluster up or down by hand, inspect one, and generate the
KubeRay manifests / `ray job submit` line from a recipe. Mounted by kimi_pipeline/cli.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from kimi_pipeline import stages  # `stages.cluster.run`: a bare `cluster` would read as this package
from kimi_pipeline.cli_recipes import RECIPE_HELP, SET_HELP, recipe_or_exit
from kimi_pipeline.cluster.cluster_errors import ClusterError
from kimi_pipeline.cluster.kuberay import (
    MANIFEST_DIR,
    check_manifest,
    manifest_path,
    manifest_presets,
    render_manifest,
    write_manifest,
)
from kimi_pipeline.cluster.lifecycle import resolve_address, stop_cluster
from kimi_pipeline.cluster.local import LocalCluster
from kimi_pipeline.cluster.ray_submit import ray_submit_text
from kimi_pipeline.cluster.readiness import connected, read_facts
from kimi_pipeline.errors import PermanentError
from kimi_pipeline.stages import CLUSTER, stage_run

cluster_app = typer.Typer(no_args_is_help=True, help="Ray cluster: up/down/status, KubeRay manifests, job command.")

def _fail(e: Exception) -> typer.Exit:
    typer.echo(f"error: {e}", err=True)
    return typer.Exit(1)


@cluster_app.command("up")
def up(
    recipe: str = typer.Option("tiny", "--recipe", "-r", help=RECIPE_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    run_dir: Path = typer.Option(..., "--run-dir"),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Health-check timeout in seconds."),
) -> None:
    """Start (or attach to) the recipe's cluster and keep it running; `kimi cluster down` stops it."""

    r = recipe_or_exit(recipe, set_)
    r.cluster.keep = True  # this process exits right away; the cluster must not go with it
    try:
        with stage_run(CLUSTER, r, run_dir) as record:
            section = record(stages.cluster.run(r, run_dir, timeout_s=timeout))
    except (ClusterError, PermanentError) as e:
        raise _fail(e) from None
    typer.echo(json.dumps({k: v for k, v in section.items() if k != "node_list"}, indent=2))


@cluster_app.command("down")
def down(run_dir: Path = typer.Option(..., "--run-dir")) -> None:
    """Stop the embedded cluster a run started (only its processes; other Ray clusters are untouched)."""

    report = stop_cluster(run_dir, keep=False)
    typer.echo("no running embedded cluster recorded in " + str(run_dir) if report is None else json.dumps(report))


@cluster_app.command("status")
def status(
    run_dir: Optional[Path] = typer.Option(None, "--run-dir"),
    address: Optional[str] = typer.Option(None, "--address", help="GCS address HOST:PORT (instead of --run-dir)."),
) -> None:
    """Nodes and resources of a live cluster, as JSON."""

    if address is None:
        c = LocalCluster.load(run_dir) if run_dir else None
        if c is None or c.stopped or not c.address:
            raise _fail(ValueError(f"no live cluster recorded in {run_dir}; pass --address HOST:PORT"))
        address = c.address
    with connected(resolve_address(address)):
        facts = read_facts()
    typer.echo(json.dumps(facts.to_dict(), indent=2))


@cluster_app.command("manifest")
def manifest(
    recipe: Optional[str] = typer.Option(None, "--recipe", "-r", help=RECIPE_HELP + " Default: every GPU preset."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    write: bool = typer.Option(False, "--write", help="Write infra/kuberay/<recipe>.yaml."),
    check: bool = typer.Option(False, "--check", help="Exit 1 if the shipped manifest differs from the recipe."),
    image: Optional[str] = typer.Option(None, "--image", help="Container image (default kimi-pipeline:<version>)."),
    out_dir: Optional[Path] = typer.Option(None, "--dir", help="Manifest directory (default infra/kuberay)."),
) -> None:
    """KubeRay RayCluster manifest generated from a recipe (print, --write, or --check for drift)."""

    directory = out_dir or MANIFEST_DIR
    names = [recipe] if recipe else manifest_presets()
    recipes = [recipe_or_exit(n, set_) for n in names]
    if check:
        problems = [p for r in recipes if (p := check_manifest(r, manifest_path(r.name, directory), image))]
        for p in problems:
            typer.echo(p, err=True)
        if problems:
            raise typer.Exit(1)
        typer.echo(f"up to date: {', '.join(r.name for r in recipes)}")
    elif write:
        for r in recipes:
            typer.echo(f"wrote {write_manifest(r, directory, image)}")
    else:
        typer.echo("\n---\n".join(render_manifest(r, image) for r in recipes), nl=False)


@cluster_app.command("job-command")
def job_command(
    recipe: str = typer.Option(..., "--recipe", "-r", help=RECIPE_HELP),
    dashboard: str = typer.Option("http://127.0.0.1:8265", "--dashboard", help="The head's dashboard URL."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """The `ray job submit` line that runs this pipeline as a Ray job (venv interpreter, absolute path)."""

    recipe_or_exit(recipe, set_, check=False)
    typer.echo(ray_submit_text(recipe, dashboard, set_))
