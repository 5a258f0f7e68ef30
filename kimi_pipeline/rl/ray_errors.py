"""What the train stage raises when something on the Ray cluster fails, and why: the task layer retries a stage
only for errors a retry can fix, so each failure is sorted here. A PermanentError raised inside an actor (a bad model
or recipe, a 400 from an engine) stays permanent through Ray's wrappers; a lost actor, node or engine becomes a
retryable `TrainingError` naming the actor; a Ray head that stopped answering is `RayHeadLost`, permanent, since a
retry would only dial the dead address again. These rules live apart from the step loop (`rl.loop`) so that the loop
reads as the steps it runs, and so that a test can hand them Ray's own exceptions without a training run.
"""

from __future__ import annotations

import re
from pathlib import Path

from kimi_pipeline.cluster.env import gcs_reachable
from kimi_pipeline.engine.client import EngineRequestError
from kimi_pipeline.errors import PermanentError


class TrainingError(RuntimeError):
    """A transient training failure (lost actor, engine down): the stage retry resumes from the checkpoint."""


class RayHeadLost(PermanentError):
    """The Ray head stopped answering mid-train: the cluster's actors, placement groups and object store went with
    it, and a task retry would only dial the dead address again. The flow's re-run brings a cluster up (its cluster
    stage) and resumes from the latest checkpoint."""


def head_lost(e: BaseException, head: str, checkpoints: Path) -> RayHeadLost | None:
    """`RayHeadLost` for `e` when the Ray head at `head` no longer answers (its message says how to come back to
    the checkpoints in `checkpoints`); None while it answers."""
    if gcs_reachable(head):
        return None
    return RayHeadLost(f"the Ray head at {head} stopped answering during training ({type(e).__name__}: "
                       f"{first_line(e)}): the cluster and every actor on it are gone. Bring the cluster back "
                       "(a re-run of the flow starts one in its cluster stage; an external cluster: restart "
                       f"its head), then re-run: training resumes from the latest checkpoint in {checkpoints}")


def stage_error(e: Exception, engine_names: dict[str, str] | None = None) -> Exception:
    """What the stage raises for a failure inside the actors or engines: a PermanentError (bad model, bad
    recipe, a 400 from an engine) stays permanent even when Ray wraps it, so the task does not retry what a
    retry cannot fix; anything else (a lost actor, node or engine) is a retryable TrainingError naming the
    actor that failed. `engine_names`: engine URL → the engine actor's name, for errors that only carry a URL."""

    cause = root_cause(e)  # Ray's RayTaskError carries the actor's own exception
    if isinstance(e, PermanentError) and cause is e:
        return e
    if isinstance(cause, PermanentError):  # its own message, not the Ray traceback around it
        return PermanentError(f"{type(cause).__name__} in a training actor: {cause}")
    what = "rollout engine" if isinstance(e, EngineRequestError) or isinstance(cause, EngineRequestError) \
        else "training actors"
    first = first_line(e)  # for an actor's exception: Ray's "ray::Actor.method() (pid=…)" line …
    if cause is not e:  # … and the actor's own message
        first = f"{first}: {first_line(cause)}"
    first += _failed_actor(e, first, engine_names or {})
    return TrainingError(f"{what} failed ({type(e).__name__}): {first}; a retry resumes from the latest checkpoint")


def _failed_actor(e: BaseException, first: str, engine_names: dict[str, str]) -> str:
    """The failed actor where the first line does not name it: a dead actor's class (Ray writes it on a later
    line: "class_name: PolicyWorker"), or the engine behind a URL an HTTP error names."""
    text = str(e)
    m = re.search(r"^\s*class_name: (\S+)", text, re.M)
    if m and m.group(1) not in first:
        where = ", ".join(f"{k} {v}" for k, v in re.findall(r"^\s*(pid|ip): (\S+)", text, re.M))
        return f" [actor {m.group(1)}{f' ({where})' if where else ''}]"
    # the URL itself, not a prefix of another (":3000" is not ":30001")
    named = [name for url, name in engine_names.items() if re.search(re.escape(url) + r"(?![\w.])", text)]
    return f" [{', '.join(named)}]" if named else ""


def root_cause(e: BaseException) -> BaseException:
    """The exception an actor raised, through Ray's wrappers: the rollout manager's call into an engine actor
    nests one RayTaskError in another."""
    seen = 0
    while getattr(e, "cause", None) is not None and seen < 8:
        e, seen = e.cause, seen + 1  # type: ignore[attr-defined]
    return e


def first_line(e: BaseException) -> str:
    """The first line of `e`'s message, uncoloured and at most 300 characters (Ray's messages run to tracebacks)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()  # Ray colours its lines
    return text.splitlines()[0][:300] if text else ""
