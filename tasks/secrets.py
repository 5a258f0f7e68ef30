"""Secrets from Prefect Secret blocks when they exist (env vars otherwise); never logged."""

from __future__ import annotations

import os


def secret(block_name: str, env_var: str) -> str | None:
    if os.environ.get(env_var):
        return os.environ[env_var]
    try:
        from prefect.blocks.system import Secret

        return Secret.load(block_name, _sync=True).get()
    except Exception:  # no such block / no API: the secret is simply not configured
        return None


def hf_token() -> str | None:
    return secret("hf-token", "HF_TOKEN")


def wandb_key() -> str | None:
    return secret("wandb-api-key", "WANDB_API_KEY")
