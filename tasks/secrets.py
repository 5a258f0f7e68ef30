"""Secrets from Prefect Secret blocks when they exist (env vars otherwise); never logged.

Each value found is registered for redaction: a block's value is in no env var, so without it summary.json, logs,
artifacts and FAILED.md would not know to hide it."""

from __future__ import annotations

import os

from kimi_pipeline.util.redact import register_secret
from kimi_pipeline.util.secret_env import WANDB_KEY_ENV


def secret(block_name: str, env_var: str) -> str | None:
    if os.environ.get(env_var):
        return os.environ[env_var]
    try:
        from prefect.blocks.system import Secret

        value = Secret.load(block_name, _sync=True).get()
    except Exception:  # no such block / no API: the secret is simply not configured
        return None
    register_secret(value if isinstance(value, str) else None, env_var)
    return value


def hf_token() -> str | None:
    return secret("hf-token", "HF_TOKEN")


def wandb_key() -> str | None:
    return secret("wandb-api-key", WANDB_KEY_ENV)
