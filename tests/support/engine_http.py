"""Raw HTTP to a rollout engine as the tests write it: httpx's request / get / post with the run's key, which
every engine requires on every endpoint but /health* (`kimi_pipeline.engine.key`). A test that means to go
without the key calls httpx itself."""

from __future__ import annotations

from typing import Any

import httpx

from kimi_pipeline.engine.key import auth_headers


def request(method: str, url: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, url, headers=auth_headers(), **kwargs)


def get(url: str, **kwargs: Any) -> httpx.Response:
    return request("GET", url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return request("POST", url, **kwargs)
