"""The secrets a run finds in its environment, and the environment of the processes that have no use for them.

Only the flow's own process uses the hub token (the download stage), the W&B key (the train stage's metrics
mirror, in its driver) and the failure webhook (the failure hook). The processes it starts — the embedded Ray
cluster (and so every trainer, engine and rollout actor, which inherit the raylet's environment), local weight-job
ranks, reward graders, export checks, SGLang — get an environment without them: a process that does not hold a
secret cannot print it, dump it into a core file or a crash report, or hand it to the code it runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

HUB_TOKEN_ENVS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
WANDB_KEY_ENV = "WANDB_API_KEY"
WEBHOOK_ENV = "KIMI_NOTIFY_WEBHOOK"  # a Slack-style webhook URL is itself the credential that lets anyone post
# what only the flow's own process reads; every process it starts goes without them
FLOW_ONLY_ENVS = (*HUB_TOKEN_ENVS, WANDB_KEY_ENV, WEBHOOK_ENV)
# every secret an environment can hold: the Ray cluster token is needed by every Ray process (token auth) and the
# run's engine key by every engine and its clients (`engine/key.py`), so they are redacted wherever they show but
# kept in the environment of the processes a run starts
SECRET_ENVS = (*FLOW_ONLY_ENVS, "RAY_AUTH_TOKEN", "KIMI_ENGINE_API_KEY")


def without_secrets(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) without the secrets only the flow's process uses."""
    env = os.environ if base is None else base
    return {k: v for k, v in env.items() if k not in FLOW_ONLY_ENVS}
