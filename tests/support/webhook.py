"""A webhook on loopback for the HTTP sink tests: records what arrives, in arrival order.

Keep-alive HTTP/1.1 on a `ThreadingHTTPServer` thread (one handler thread per connection, so
concurrent requests really overlap). `respond(body)` decides each answer as `(status, delay_s)`
from the parsed JSON body (an envelope, or a list of them in batch mode), so a test can delay
some requests, fail others, and read how many were in flight at once.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

Respond = Callable[[Any], tuple[int, float]]


def always_ok(_body: Any) -> tuple[int, float]:
    return 204, 0.0


class _Server(ThreadingHTTPServer):
    request_queue_size = 128
    """The default backlog (5) drops SYNs when 16 connections open at once: 1-s retransmits."""


class Webhook:
    def __init__(self, respond: Respond = always_ok) -> None:
        self.respond = respond
        self.lock = threading.Lock()
        self.arrived: list[int] = []
        """Ids in the order their requests arrived (a retried id appears once per attempt)."""
        self.accepted: list[int] = []
        """Ids answered with a 2xx, in arrival order."""
        self.bodies: list[Any] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._stop = threading.Event()
        self.server = _Server(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hook = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                ids = [e["id"] for e in body] if isinstance(body, list) else [body["id"]]
                with hook.lock:
                    hook.in_flight += 1
                    hook.max_in_flight = max(hook.max_in_flight, hook.in_flight)
                    hook.arrived.extend(ids)
                    hook.bodies.append(body)
                    hook.headers.append(dict(self.headers))
                status, delay_s = hook.respond(body)
                if delay_s:
                    hook._stop.wait(delay_s)  # cut short when the test ends
                with hook.lock:
                    hook.in_flight -= 1
                    if status < 300:
                        hook.accepted.extend(ids)
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:  # the sink gave up on this request (a cancelled batch)
                    self.close_connection = True

            def log_message(self, *args: object) -> None:
                return None

        return Handler

    def __enter__(self) -> Webhook:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)
