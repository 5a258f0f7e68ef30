"""Failure notification for flow `kimi`: an `on_failure` / `on_crashed` hook.

What a person woken up by a failed nightly run needs, in three places: `DIR/FAILED.md` (next to
summary.json), an ERROR line in the flow run's log, and — when `KIMI_NOTIFY_WEBHOOK` is set — a JSON
POST (Slack-compatible `text` field) to that URL. Secrets known to this process are redacted from all
three (`kimi_pipeline.util.redact`: secret env values, Prefect Secret values, token shapes). Hooks run in the
flow's process after its final state is set: they must never raise.
A server-side Prefect Automation (README) covers runs whose process died before a hook could run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx  # a Prefect dependency; no extra package

from kimi_pipeline.util.files import atomic_write_text
from kimi_pipeline.util.redact import redact, redact_data
from kimi_pipeline.util.run_lock import held_elsewhere
from kimi_pipeline.util.secret_env import WEBHOOK_ENV

FAILED_FILE = "FAILED.md"
_RUN_DIRS: dict[str, Path] = {}  # flow run id -> run dir (a default run dir is only known inside the flow)


def remember_run_dir(run_dir: Path) -> None:
    """Called by the flow once its run directory exists, so that the hooks can find it."""
    from prefect.runtime import flow_run

    if flow_run.id:
        _RUN_DIRS[str(flow_run.id)] = Path(run_dir)


def _run_dir(flow_run) -> Path | None:
    if str(flow_run.id) in _RUN_DIRS:
        return _RUN_DIRS[str(flow_run.id)]
    given = (flow_run.parameters or {}).get("run_dir")
    if not given or held_elsewhere(given):  # another run's directory (this one failed to take it): not ours to write
        return None
    return Path(given)


def _failed_stages(run_dir: Path | None) -> list[tuple[str, str]]:
    if run_dir is None or not (run_dir / "summary.json").is_file():
        return []
    try:
        stages = json.loads((run_dir / "summary.json").read_text()).get("stages", {})
    except (OSError, ValueError):
        return []
    return [(name, str(s.get("error") or "")) for name, s in stages.items() if s.get("status") == "failed"]


def _ui_url(flow_run_id: Any) -> str | None:
    from prefect.settings import PREFECT_UI_URL

    base = PREFECT_UI_URL.value()
    return f"{base.rstrip('/')}/runs/flow-run/{flow_run_id}" if base else None


def failure_report(flow_run, state, run_dir: Path | None) -> dict[str, Any]:
    """The facts of a failed run (also the webhook payload), redacted whole: parameters too."""
    stages = _failed_stages(run_dir)
    message = str(state.message or state.name)
    stage_text = "; ".join(f"{name}: {err.splitlines()[0] if err else 'failed'}" for name, err in stages)
    text = (f"kimi flow run {flow_run.name!r} {state.name}"
            + (f" in stage {', '.join(n for n, _ in stages)}" if stages else "")
            + f": {stage_text or message}"
            + (f" (run dir {run_dir})" if run_dir else ""))
    return redact_data({
        "text": text,
        "flow_run_id": str(flow_run.id),
        "flow_run_name": flow_run.name,
        "deployment_id": str(flow_run.deployment_id) if flow_run.deployment_id else None,
        "state": state.name,
        "message": message,
        "failed_stages": [n for n, _ in stages],
        "run_dir": str(run_dir) if run_dir else None,
        "ui_url": _ui_url(flow_run.id),
        "parameters": {k: v for k, v in (flow_run.parameters or {}).items()},
    })


def failure_markdown(report: dict[str, Any], run_dir: Path | None) -> str:
    """DIR/FAILED.md's text, redacted whole (like the report it is made from)."""
    lines = [f"# Run failed: {report['state']}", "", report["text"], ""]
    if report["ui_url"]:
        lines += [f"Prefect UI: {report['ui_url']}", ""]
    lines += [
        f"- flow run: `{report['flow_run_name']}` ({report['flow_run_id']})",
        f"- failed stage(s): {', '.join(report['failed_stages']) or 'none recorded (see the flow run log)'}",
        f"- state message: {report['message']}",
        "",
        "Re-running with the same parameters (same `run_dir`) reuses the cached stages and resumes training "
        "from its latest checkpoint" + (f": see `{run_dir / 'summary.json'}` for every stage." if run_dir else "."),
    ]
    return redact("\n".join(lines) + "\n")


def post_webhook(url: str, payload: dict[str, Any], timeout_s: float = 10.0) -> int:
    return httpx.post(url, json=payload, timeout=timeout_s).status_code


def notify_failure(flow, flow_run, state) -> None:
    """`on_failure` / `on_crashed` hook of flow `kimi`."""
    from prefect.logging.loggers import flow_run_logger

    logger = flow_run_logger(flow_run, flow)
    try:
        run_dir = _run_dir(flow_run)
        report = failure_report(flow_run, state, run_dir)
        if run_dir is not None and run_dir.is_dir():
            atomic_write_text(run_dir / FAILED_FILE, failure_markdown(report, run_dir))
        logger.error("RUN FAILED: %s", report["text"] + (f" — {report['ui_url']}" if report["ui_url"] else ""))
        url = os.environ.get(WEBHOOK_ENV)
        if url:
            code = post_webhook(url, report)
            logger.info("failure notification posted to %s (HTTP %d)", WEBHOOK_ENV, code)
    except Exception as e:  # noqa: BLE001 - a hook must not turn one failure into two
        logger.error("failure notification incomplete: %s", redact(f"{type(e).__name__}: {e}"))


def clear_failure(flow, flow_run, state) -> None:
    """`on_completion` hook: a successful re-run of the same run dir removes the stale FAILED.md."""
    run_dir = _run_dir(flow_run)
    if run_dir is not None:
        (run_dir / FAILED_FILE).unlink(missing_ok=True)


# --------------------------------------------------------------------------- server-side: a Prefect Automation

AUTOMATION = "kimi-run-failed"
WEBHOOK_BLOCK = "kimi-notify-webhook"
AUTOMATION_PAYLOAD = (
    '{"text": "kimi flow run {{ flow_run.name }} {{ flow_run.state.name }} (Prefect automation)", '
    '"flow_run_id": "{{ flow_run.id }}", "state": "{{ flow_run.state.name }}", "source": "prefect-automation"}'
)


def ensure_failure_automation(webhook_url: str, states: tuple[str, ...] = ("Crashed",), name: str = AUTOMATION):
    """(Re)create the Automation `name`: a run of flow `kimi` entering one of `states` → POST to `webhook_url`.

    Server-side, so it also fires when the flow's process died and no hook could run (Crashed: killed
    worker, lost host). Default Crashed only: `Failed` is already reported by the hook, with the failed
    stage and the run dir. The URL is kept in a Webhook block (a secret field), not in the automation.
    """
    from prefect.automations import Automation
    from prefect.blocks.webhook import Webhook
    from prefect.events.actions import CallWebhook
    from prefect.events.schemas.automations import EventTrigger, Posture

    block_id = Webhook(url=webhook_url, method="POST").save(WEBHOOK_BLOCK, overwrite=True)
    try:
        Automation.read(name=name).delete()
    except ValueError:  # no such automation yet
        pass
    return Automation(
        name=name,
        description=f"Flow `kimi` run {' or '.join(states)} → webhook block {WEBHOOK_BLOCK}",
        trigger=EventTrigger(
            expect={f"prefect.flow-run.{s}" for s in states},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": "kimi"},
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[CallWebhook(block_document_id=block_id, payload=AUTOMATION_PAYLOAD)],
    ).create()
