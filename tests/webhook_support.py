"""A webhook receiver on 127.0.0.1 that verifies every delivery's Standard
Webhooks signature with the official SDK (``client.webhooks.unwrap``), and
can be stopped and started again on the same port."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai

__all__ = ["Receiver"]


class Receiver:
    def __init__(self) -> None:
        self.secret = ""
        # The status the receiver answers with.
        self.status = 200
        self.verified: list[tuple[str, dict[str, Any]]] = []
        self.unsigned: list[bytes] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._sdk = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1", max_retries=0)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    def _handle(self, headers: dict[str, str], body: bytes) -> int:
        try:
            self._sdk.webhooks.unwrap(body, headers, secret=self.secret)
        except Exception:
            with self._lock:
                self.unsigned.append(body)
            return 400
        if self.status < 300:
            with self._lock:
                self.verified.append((headers["webhook-id"], json.loads(body)))
        return self.status

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's naming
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                status = receiver._handle({k.lower(): v for k, v in self.headers.items()}, body)
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = server.server_address[1]
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def events(self, event_type: str) -> list[dict[str, Any]]:
        with self._lock:
            return [event for _, event in self.verified if event["type"] == event_type]
