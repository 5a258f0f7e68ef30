"""A loopback HTTP endpoint that records JSON POSTs: the receiving end of failure notifications."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def webhook_receiver() -> Iterator[tuple[str, list[dict]]]:
    """`with webhook_receiver() as (url, received):` — every JSON body POSTed to `url` lands in `received`."""
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server API
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            received.append(json.loads(body or b"{}"))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/notify", received
    finally:
        server.shutdown()


def wait_for(received: list[dict], count: int, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while len(received) < count and time.monotonic() < deadline:
        time.sleep(0.25)
    return received
